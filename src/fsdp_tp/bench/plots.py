"""PNG plots of the benchmark (matplotlib, the ``bench`` extra: ``pip install -e ".[bench]"``)."""

from __future__ import annotations

from pathlib import Path

from .figures import Figures, median

__all__ = ["plot_all", "plot_training_effect"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(
            'the plots need matplotlib: pip install -e ".[bench]" (or run fsdp-tp bench --no-plots)'
        ) from err
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, labels: list[str], values: list[float], title: str, unit: str, log: bool = False) -> None:
    colors = ["#1f77b4" if "/fsdp_tp" in s else "#ff7f0e" if "gspmd" in s else "#7f7f7f" for s in labels]
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(unit, fontsize=8)
    if log:
        ax.set_xscale("log")


def plot_all(
    results: dict[str, list[Figures]],
    times: dict[str, dict[str, list[float]]],
    compile_times: dict[tuple[int, bool], float],
    out_dir: Path,
) -> list[str]:
    """Writes one PNG per figure kind into ``out_dir``; returns their paths."""
    plt = _pyplot()
    paths = []
    for key, unit, pick in [
        ("wire", "MB per device per step (log)", lambda f, _t: f.wire_total / 1e6),
        ("state", "MB per device (params + AdamW state)", lambda f, _t: f.state_bytes / 1e6),
        (
            "step_time",
            "ms per step, median of blocks",
            lambda f, t: median(t[f.label]) * 1e3 if f.label in t else 0,
        ),
    ]:
        fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 6))
        for ax, (name, figures) in zip(axes, results.items(), strict=True):
            labels = [f.label for f in figures]
            values = [pick(f, times.get(name, {})) for f in figures]
            _bars(ax, labels, [max(v, 1e-3) for v in values], name, unit, log=key == "wire")
        fig.suptitle(f"{key.replace('_', ' ')}: fsdp_tp (blue), GSPMD (orange), others (grey)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"bench_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    if compile_times:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for scan, style in ((True, "o-"), (False, "s--")):
            points = sorted((k[0], v) for k, v in compile_times.items() if k[1] == scan)
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], style, label="nn.scan" if scan else "unrolled"
            )
        ax.set_xlabel("layers")
        ax.set_ylabel("compile seconds")
        ax.set_title("GPT-style model: compile time against depth", fontsize=9)
        ax.legend()
        fig.tight_layout()
        path = out_dir / "bench_compile.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def plot_training_effect(losses: dict[str, list[float]], steps: int, out_dir: Path) -> str:
    """The main job's held-out loss per precision policy (``{label: [loss per seed]}``), each
    seed a dot, against bf16 gathers' seed-to-seed range (shaded); returns the PNG's path."""
    plt = _pyplot()
    base = losses["bf16 / f32"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.axvspan(min(base), max(base), color="#dddddd", label="bf16 / f32: seed to seed")
    for row, values in enumerate(losses.values()):
        ax.plot(
            values, [row] * len(values), "o", color="#1f77b4" if "fp8" in list(losses)[row] else "#7f7f7f"
        )
    ax.set_yticks(range(len(losses)), list(losses), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"held-out loss after {steps} steps (fsdp-tp train)", fontsize=8)
    ax.set_title("gather / reduce-scatter dtype: the training effect", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "bench_precision.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
