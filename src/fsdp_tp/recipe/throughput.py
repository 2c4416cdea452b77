"""What a step achieves on its device: TFLOP/s, MFU against the device's peak, memory in use.

MFU (model FLOPs utilisation) is the model's FLOPs per second (``ModelConfig.flops_per_token``
times tokens per second, recomputation not counted) over the devices' peak. The peak comes
from a table of dense (no sparsity) figures from the vendors' data sheets, in the compute
dtype, or from ``--peak-tflops``; a CPU has no entry, so no MFU is shown there.

>>> peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16"), peak_tflops("cpu", "float32")
(989.0, None)
>>> achieved = Achieved.of(flops_per_token=6e9, tokens_per_s=80_000, devices=1, peak=989.0)
>>> achieved.text()
'480 TFLOP/s/device, MFU 48.5%'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax

__all__ = ["PEAK_TFLOPS", "Achieved", "memory_in_use", "memory_stats", "peak_tflops"]

# (a substring of jax's device_kind, checked in this order): {compute dtype: dense TFLOP/s}.
# f32 matmuls on NVIDIA GPUs run as TF32 by default in XLA, so their peak is TF32's.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
    ("H100", {"bfloat16": 989.0, "float32": 494.5}),
    ("H200", {"bfloat16": 989.0, "float32": 494.5}),
    ("A100", {"bfloat16": 312.0, "float32": 156.0}),
    ("TPU v6 lite", {"bfloat16": 918.0}),
    ("TPU v5 lite", {"bfloat16": 197.0}),
    ("TPU v5", {"bfloat16": 459.0}),
    ("TPU v4", {"bfloat16": 275.0}),
)


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """The table's peak for ``device_kind`` computing in ``dtype``; ``None`` if it has none."""
    for name, peaks in PEAK_TFLOPS:
        if name in device_kind:
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class Achieved:
    """Model TFLOP/s per device, and their fraction of the peak (``None`` without a peak)."""

    tflops_per_device: float
    mfu: float | None

    @classmethod
    def of(cls, flops_per_token: float, tokens_per_s: float, devices: int, peak: float | None) -> Achieved:
        per_device = flops_per_token * tokens_per_s / devices / 1e12
        return cls(per_device, per_device / peak if peak else None)

    def text(self) -> str:
        mfu = f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else ""
        return f"{self.tflops_per_device:.3g} TFLOP/s/device{mfu}"

    def fields(self) -> dict:
        """For the JSON log."""
        return asdict(self)


def memory_stats() -> dict | None:
    """The first local device's allocator statistics (accelerators report them; ``None`` or
    empty on the CPU backend)."""
    device = jax.local_devices()[0]
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def memory_in_use() -> tuple[int, int] | None:
    """Bytes in use on the first local device now, and at the most, where the backend reports
    them (accelerators do; the CPU backend does not: ``None``)."""
    stats = memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_in_use"]), int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
