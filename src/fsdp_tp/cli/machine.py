"""Which devices a run uses and which mesh fits them.

Simulated CPU devices when ``--cpu-devices`` is given, when ``JAX_PLATFORMS`` names only
``cpu``, or when no accelerator plugin is installed; the accelerators otherwise. Without
``--mesh``, ``train`` puts every accelerator (or the ``--cpu-devices N`` simulated devices) on
``fsdp``, and otherwise simulates the default 2 x 2 x 2 mesh's 8 devices on CPU. A mesh that
does not fit gets the meshes that would:

>>> fitting_meshes(8, num_heads=4, num_kv_heads=2, batch=16)
['fsdp=8', 'data=2,fsdp=4', 'data=4,fsdp=2', 'data=8', 'fsdp=4,tensor=2']
"""

from __future__ import annotations

import importlib.util
import math
import os

from .checks import UsageError
from .distributed import join, requested
from .options import DEFAULT_MESH

__all__ = [
    "check_cpu_devices",
    "check_mesh_fits",
    "check_platforms",
    "fitting_meshes",
    "requested_cpu_devices",
    "select_devices",
    "uses_accelerator",
]

_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")


# JAX_PLATFORMS names -> the plugins that provide them (any one will do).
_PROVIDERS = {
    "tpu": ("libtpu",),
    "cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin"),
    "gpu": ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"),
    "rocm": ("jax_rocm60_plugin",),
}


def check_platforms() -> None:
    """Refuses ``JAX_PLATFORMS`` naming an accelerator whose plugin is not installed: the run
    would otherwise train on simulated CPU devices without a word."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    for platform in platforms:
        plugins = _PROVIDERS.get(platform.lower())
        if plugins and not any(importlib.util.find_spec(m) for m in plugins):
            raise UsageError(
                f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} asks for {platform}, but no {platform} "
                f"plugin ({' or '.join(plugins)}) is installed here; install jax for it, or unset "
                f"JAX_PLATFORMS (or set it to cpu) to train on simulated CPU devices."
            )


def uses_accelerator(args) -> bool:
    """Whether this run takes the machine's accelerators rather than simulated CPU devices."""
    if getattr(args, "cpu_devices", None):
        return False
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and set(platforms) <= {"cpu"}:  # the user asked for the CPU, plugin or not
        return False
    return any(importlib.util.find_spec(m) for m in _PLUGINS)


def select_devices(args, sizes: dict | None) -> None:
    """Joins the multi-process run if asked, then picks the devices, before JAX starts:
    ``sizes``' product of simulated CPU devices (over the processes), or the accelerators
    (``sizes`` is ``None`` when the mesh is to be chosen from them)."""
    from ..mesh import simulate_cpu_devices

    processes = requested(args.coordinator, args.num_processes, args.process_id, args.distributed)
    if not uses_accelerator(args):
        total = math.prod((sizes or _default_sizes()).values())
        simulate_cpu_devices(args.cpu_devices or max(total // max(processes, 1), 1))
    if processes != 1:
        join(
            args.coordinator,
            args.num_processes,
            args.process_id,
            args.distributed,
            args.coordinator_timeout,
            args.peer_timeout,
        )


def _default_sizes() -> dict:
    from ..mesh import parse_mesh

    return parse_mesh(DEFAULT_MESH)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fitting_meshes(
    devices: int, num_heads: int, num_kv_heads: int, batch: int, microbatches: int = 1, limit: int = 5
) -> list[str]:
    """Meshes of ``devices`` devices the model and batch can use (``data x fsdp`` divides the
    batch into whole microbatches, ``tensor`` splits the heads), least tensor parallelism and
    most FSDP first, as ``--mesh`` values."""
    found = []
    for tensor in _divisors(devices):
        heads_ok = num_heads % tensor == 0 and (num_kv_heads % tensor == 0 or tensor % num_kv_heads == 0)
        shards = devices // tensor
        if not heads_ok or batch % shards or (batch // shards) % microbatches:
            continue
        for data in _divisors(shards):
            sizes = {"data": data, "fsdp": shards // data, "tensor": tensor}
            found.append(",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "fsdp=1")
    return found[:limit]


def requested_cpu_devices(args) -> int | None:
    """The devices ``--cpu-devices N`` will make over every process, known before any exists
    (each costs memory and threads); ``None`` without the flag or with ``--distributed``."""
    per_process = getattr(args, "cpu_devices", None)
    processes = requested(args.coordinator, args.num_processes, args.process_id, args.distributed)
    return per_process * processes if per_process and processes >= 1 else None


def check_cpu_devices(args) -> None:
    """``--cpu-devices N`` with the mesh chosen from the devices (all on fsdp, a batch axis):
    the devices over every process must divide ``--batch``. Raises ``UsageError``."""
    total = requested_cpu_devices(args)
    if total is None or args.batch % total == 0:
        return
    processes = total // args.cpu_devices
    across = f" x {processes} processes = {total} devices" if processes > 1 else ""
    fits = [n for n in range(1, args.batch + 1) if args.batch % (n * processes) == 0]
    raise UsageError(
        f"--cpu-devices {args.cpu_devices}{across}, all on fsdp, cannot split --batch {args.batch} "
        f"(every device takes an equal share): give --cpu-devices one of {fits} per process, "
        f"or a --batch that is a multiple of {total}."
    )


def check_mesh_fits(sizes: dict, devices: int, settings) -> None:
    """Raises ``UsageError`` naming meshes that would fit when ``sizes`` does not cover
    ``devices`` exactly."""
    wanted = math.prod(sizes.values())
    if wanted == devices:
        return
    config = settings.model
    options = fitting_meshes(
        devices, config.num_heads, config.num_kv_heads, settings.batch, settings.microbatches
    )
    mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
    hint = (
        f"; meshes that fit: {', '.join(options)}"
        if options
        else (
            f"; no mesh of {devices} devices divides --batch {settings.batch} and --heads {config.num_heads}"
        )
    )
    raise UsageError(
        f"--mesh {mesh} needs {wanted} devices, but {devices} are here{hint} "
        f"(or leave out --mesh to use them all on fsdp)."
    )
