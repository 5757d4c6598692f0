"""What every study shares: the result shape, the output files, and the hardware a profile gives.

A study returns a ``StudyResult``: its rows (one dict per table row), a function that draws its
figure, and a summary. ``write_outputs`` writes NAME.csv, NAME.md and NAME.png atomically.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from costmodel.figures import save_figure
from costmodel.hardware import HardwareSpec
from costmodel.trace import atomic_write
from costmodel.workload import Workload


@dataclass
class StudyResult:
    name: str
    title: str
    rows: list[dict]
    draw: Callable[[object], None]  # draws on a matplotlib Figure
    summary: dict = field(default_factory=dict)


def cell(value) -> str:
    """A table cell: a float to four significant digits, None empty."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def columns(rows: list[dict]) -> list[str]:
    """Every key of the rows, in the order they first appear (a row may leave some out: a
    configuration that does not fit has no speed)."""
    return list(dict.fromkeys(key for row in rows for key in row))


def to_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_outputs(result: StudyResult, out_dir: str | Path) -> dict[str, str]:
    """The study's table as CSV and Markdown, and its figure (without matplotlib, no figure:
    the returned paths say which were written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{result.name}.csv", "markdown": out / f"{result.name}.md"}
    atomic_write(paths["csv"], to_csv(result.rows))
    extra = "".join(f"\n## {title}\n\n" + to_markdown(table)
                    for title, table in result.summary.get("tables", {}).items())
    atomic_write(paths["markdown"], f"# {result.title}\n\n" + to_markdown(result.rows)
                      + extra)
    figure = out / f"{result.name}.png"
    if save_figure(figure, result.draw, (9, 5.5)):
        paths["figure"] = figure
    return {k: str(v) for k, v in paths.items()}


def hardware_or_profile(default: str, profile: HardwareSpec | None) -> HardwareSpec:
    from costmodel import get_hardware

    return profile if profile is not None else get_hardware(default)


def all_hardware(profile: HardwareSpec | None, small: bool) -> list[HardwareSpec]:
    """Every hardware preset (two on a small grid), plus the profile's hardware when given."""
    from costmodel import HARDWARE

    presets = list(HARDWARE.values())
    return (presets[:2] if small else presets) + ([profile] if profile is not None else [])


def workload(hw: HardwareSpec, **fields) -> Workload:
    """A study's workload on ``hw``: in bf16 where it prices bf16 (every GPU preset and GPU
    calibration), else in the one dtype its calibration measured (a CPU's fp32)."""
    peaks = hw.roofline.peak_flops_per_s
    return Workload(dtype="bf16" if "bf16" in peaks else min(peaks), **fields)


def modes(hw: HardwareSpec) -> tuple[str, ...]:
    """The execution modes ``hw`` runs this decoder in: a CPU has no CUDA graphs."""
    return ("eager",) if hw.cpu is not None else ("eager", "graphs")


HOST_SPEEDS = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]


def host_speed_sweep(hardware: list[HardwareSpec], models: list[str],
                     launch_gap_s: float | None = None) -> list[dict]:
    """DtV's (best k) and WFD's speedup over AR as the host gets faster (every host term divided
    by the speed, as `costmodel predict --host-speed`), eager and (on a GPU) with CUDA graphs:
    whether a schedule's advantage grows or shrinks with a faster host. ``launch_gap_s``: the
    eager launch gap to start from (None: each hardware's own)."""
    from costmodel import predict

    rows = []
    for hw in hardware:
        for model in models:
            for mode in modes(hw):
                base = hw.in_mode(mode) if launch_gap_s is None else hw.with_terms(
                    cuda_graphs=mode == "graphs", launch_overhead_s=launch_gap_s)
                for speed in HOST_SPEEDS:
                    s = predict(model, base.with_host_speed(speed), workload(hw)).schedules
                    rows.append({"hardware": hw.name, "model": model, "mode": mode,
                                 "host_speed": speed, "ar_ms": s["ar"].latency_per_token_s * 1e3,
                                 "dtv_speedup": s["dtv"].speedup_vs_ar,
                                 "wfd_speedup": s["wfd"].speedup_vs_ar,
                                 "wfd_over_dtv": s["wfd"].latency_per_token_s
                                 and s["dtv"].latency_per_token_s / s["wfd"].latency_per_token_s,
                                 "ar_bound": s["ar"].bound})
    return rows
