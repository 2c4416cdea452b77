"""The benchmark's markdown: the full tables for ``docs/benchmarks.md`` and the README's headline."""

from __future__ import annotations

import re
from pathlib import Path

from .figures import Figures, median

__all__ = ["SUITE_END", "SUITE_START", "headline", "markdown", "replace_headline", "spread", "suite_section"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
START, END = "<!-- bench:headline:start -->", "<!-- bench:headline:end -->"
# The test suite's times: written by tests/suite_time.py --record, carried over by the bench.
SUITE_START, SUITE_END = "<!-- suite:start -->", "<!-- suite:end -->"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def spread(times: list[float]) -> str:
    return f"{median(times) * 1e3:,.1f} ({min(times) * 1e3:,.1f}-{max(times) * 1e3:,.1f})"


def _row(f: Figures, times: dict, gspmd: str | None, single: str) -> str:
    t = times.get(f.label)
    wire = " | ".join(_mb(f.wire.get(k, 0.0)) for k in KINDS)
    vs_gspmd = _ratio(median(t), median(times[gspmd])) if t and gspmd in times else "—"
    vs_single = _ratio(median(t), median(times[single])) if t and single in times else "—"
    return (
        f"| {f.label} | {_mb(f.state_bytes)} | {f.state_bytes / f.ideal_bytes:.3f} | {_mb(f.temp_bytes)} "
        f"| {_mb(f.total_bytes)} | {wire} | {_mb(f.wire_total)} | {_ratio(f.wire_total, f.minimum)} "
        f"| {f.full_gradient_all_reduces} | {spread(t) if t else '—'} | {vs_gspmd} | {vs_single} |"
    )


def _workload_table(title: str, figures: list[Figures], times: dict) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| strategy / implementation | state MB/device | ÷ ideal | temp MB | arg+out-alias+temp MB "
        + "".join(f"| {k} MB " for k in KINDS)
        + "| wire MB/step | ÷ minimum | full-grad all-reduces | step ms median (blocks min-max) "
        "| ÷ GSPMD | ÷ one device |",
        "|---|" + "---:|" * (11 + len(KINDS)),
    ]
    for f in figures:
        strategy = f.label.split("/")[0]
        lines.append(_row(f, times, f"{strategy}/gspmd", "single/single"))
    return [*lines, ""]


def markdown(
    results: dict[str, list[Figures]],
    titles: dict[str, str],
    times: dict[str, dict[str, list[float]]],
    compile_times: dict[tuple[int, bool], float],
    header: list[str],
    plots: list[str],
    build_times: dict[int, tuple[float, float, float]] | None = None,
) -> str:
    """The whole ``docs/benchmarks.md``."""
    lines = [*header, ""]
    for name, figures in results.items():
        lines += _workload_table(titles[name], figures, times.get(name, {}))
    lines += [
        "### Compile time against depth (GPT-style model, fsdp_tp on data=1 x fsdp=4 x tensor=2)",
        "",
        "| layers | with `nn.scan` s | unrolled s | unrolled ÷ scan |",
        "|---:|---:|---:|---:|",
    ]
    for layers in sorted({k[0] for k in compile_times}):
        scan, loop = compile_times.get((layers, True)), compile_times.get((layers, False))
        lines.append(
            f"| {layers} | {scan:.2f} | {loop:.2f} | {_ratio(loop, scan)} |"
            if scan is not None and loop is not None
            else f"| {layers} | {scan or float('nan'):.2f} | not measured (`--max-unrolled`) | — |"
        )
    lines += _build_section(build_times or {})
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def headline(results: dict[str, list[Figures]], times: dict[str, dict[str, list[float]]]) -> str:
    """The README's table: the GPT-style model, this library against GSPMD, per strategy."""
    figures = {f.label: f for f in results.get("gpt", [])}
    gpt_times = times.get("gpt", {})
    lines = [
        "| GPT-style model, 8 CPU devices | state MB/device | wire MB/step: fsdp_tp | GSPMD "
        "| fsdp_tp ÷ minimum | step time fsdp_tp ÷ GSPMD |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, f in figures.items():
        strategy, impl = label.split("/")
        if impl != "fsdp_tp":
            continue
        g = figures.get(f"{strategy}/gspmd")
        t, tg = gpt_times.get(label), gpt_times.get(f"{strategy}/gspmd")
        lines.append(
            f"| {strategy} | {_mb(f.state_bytes)} | {_mb(f.wire_total)} | {_mb(g.wire_total) if g else '—'} "
            f"| {_ratio(f.wire_total, f.minimum)} | {_ratio(median(t), median(tg)) if t and tg else '—'} |"
        )
    return "\n".join(lines)


def replace_headline(readme: Path, table: str) -> None:
    """Rewrites the README between its headline markers (left alone when they are missing)."""
    text = readme.read_text()
    if START not in text or END not in text:
        return
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text))


def _build_section(build_times: dict[int, tuple[float, float, float]]) -> list[str]:
    """Init + specs + first step compiled, unrolled, against plain flax and against depth."""
    if not build_times:
        return []
    base = build_times[min(build_times)][0]
    lines = [
        "",
        "### Build time against depth (unrolled GPT-style model: init + specs + first step compiled)",
        "",
        f"fsdp_tp on data=1 x fsdp=4 x tensor=2 (init from the twin, `twin_init_fn`) against plain flax "
        f"on one device doing the same (init under `jax.jit`, step compiled), built one after the "
        f"other in each of `--blocks` rounds: medians of the times and of the rounds' ratios; the "
        f"last column is fsdp_tp's median over its own at {min(build_times)} layers.",
        "",
        f"| layers | fsdp_tp s | plain flax s | ÷ plain flax | ÷ fsdp_tp at {min(build_times)} layers |",
        "|---:|---:|---:|---:|---:|",
    ]
    for layers, (library, plain, ratio) in sorted(build_times.items()):
        lines.append(f"| {layers} | {library:.2f} | {plain:.2f} | {ratio:.2f} | {library / base:.2f} |")
    return lines


def suite_section(previous: str | None) -> str:
    """The page's section on the test suite's time: its table as ``tests/suite_time.py --record``
    last wrote it into ``previous`` (the page before this run), which the bench does not measure.

    >>> print(suite_section(None).splitlines()[-2])
    Not measured yet: run `python tests/suite_time.py --record`.
    """
    found = re.search(re.escape(SUITE_START) + r".*?" + re.escape(SUITE_END), previous or "", re.S)
    block = (
        found.group(0)
        if found
        else (f"{SUITE_START}\nNot measured yet: run `python tests/suite_time.py --record`.\n{SUITE_END}")
    )
    return "\n### The test suite\n\n" + block + "\n"
