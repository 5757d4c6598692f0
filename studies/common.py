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
from costmodel.specs import HardwareSpec
from costmodel.trace import atomic_write_text


@dataclass
class StudyResult:
    name: str
    title: str
    rows: list[dict]
    draw: Callable[[object], None]  # draws on a matplotlib Figure
    summary: dict = field(default_factory=dict)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def to_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_outputs(result: StudyResult, out_dir: str | Path) -> dict[str, str]:
    """The study's table as CSV and Markdown, and its figure (without matplotlib, no figure:
    the returned paths say which were written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{result.name}.csv", "markdown": out / f"{result.name}.md"}
    atomic_write_text(paths["csv"], to_csv(result.rows))
    extra = "".join(f"\n## {title}\n\n" + to_markdown(table)
                    for title, table in result.summary.get("tables", {}).items())
    atomic_write_text(paths["markdown"], f"# {result.title}\n\n" + to_markdown(result.rows)
                      + extra)
    figure = out / f"{result.name}.png"
    if save_figure(figure, result.draw, (9, 5.5)):
        paths["figure"] = figure
    return {k: str(v) for k, v in paths.items()}


def hardware_or_profile(default: str, profile: HardwareSpec | None) -> HardwareSpec | str:
    return profile if profile is not None else default


def all_hardware(profile: HardwareSpec | None, small: bool) -> list[HardwareSpec | str]:
    """Every hardware preset (two on a small grid), plus the profile's hardware when given."""
    from costmodel import HARDWARE

    names: list[HardwareSpec | str] = list(HARDWARE)[:2] if small else list(HARDWARE)
    return names + ([profile] if profile is not None else [])


HOST_SPEEDS = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]


def host_speed_sweep(hardware: list[HardwareSpec | str], models: list[str],
                     launch_gap_s: float | None = None) -> list[dict]:
    """DtV's (best k) and WFD's speedup over AR as the host gets faster (every host term divided
    by the speed, as `costmodel predict --host-speed`), eager and with CUDA graphs: whether a
    schedule's advantage grows or shrinks with a faster host. ``launch_gap_s``: the eager launch
    gap to start from (None: each hardware's own)."""
    from costmodel import Workload, get_hardware, predict

    rows = []
    for hw in hardware:
        hw = get_hardware(hw) if isinstance(hw, str) else hw
        for model in models:
            for mode in ("eager", "graphs"):
                base = hw.in_mode(mode) if launch_gap_s is None else hw.with_terms(
                    cuda_graphs=mode == "graphs", launch_overhead_s=launch_gap_s)
                for speed in HOST_SPEEDS:
                    s = predict(model, base.with_host_speed(speed), Workload()).schedules
                    rows.append({"hardware": hw.name, "model": model, "mode": mode,
                                 "host_speed": speed, "ar_ms": s["ar"].latency_per_token_s * 1e3,
                                 "dtv_speedup": s["dtv"].speedup_vs_ar,
                                 "wfd_speedup": s["wfd"].speedup_vs_ar,
                                 "wfd_over_dtv": s["wfd"].latency_per_token_s
                                 and s["dtv"].latency_per_token_s / s["wfd"].latency_per_token_s,
                                 "ar_bound": s["ar"].bound})
    return rows
