"""Held-out validation of a calibration profile.

Points are of two kinds: single calls the fit never saw (other positions per call, contexts, and
a model size), priced by the cost model; and whole AR, DtV and WFD runs of the held-out size,
replayed by the event simulator with the run's own draft outcomes and compared per decoded token.
The profile stores the points with their measurements, so `costmodel validate` re-prices them
with the profile's hardware without running the model again.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from costmodel.figures import save_figure
from costmodel.hardware import HardwareSpec
from costmodel.model import LoopedModelSpec
from costmodel.profile import ValidationPoint
from costmodel.schedules import get
from costmodel.simulate import price_records, simulate


def predict_point(point: ValidationPoint, hw: HardwareSpec, dtype: str) -> float:
    hw = hw.in_mode(point.mode)
    if point.kind == "call":
        record = point.record.model_copy()
        price_records(point.spec, hw, [record], dtype=dtype)
        return record.wall_s
    kind = get(point.group)
    schedule = kind.of(point.draft_depth or 1, point.block_length or 1) if kind.drafts \
        else kind()
    res = simulate(point.spec, hw, schedule, context_length=point.prompt_length,
                   new_tokens=point.tokens, accept_sequence=point.accept, depth=point.depth,
                   dtype=dtype)
    return res.latency_per_token_s


def run_point(name: str, spec: LoopedModelSpec, run, prompt_length: int, depth: int
              ) -> ValidationPoint:
    """A measured run: its decode time per token, the wall time less the prefill's calls (the
    ones over prompt positions), with every decode call counted at the median of the run's
    calls of its shape (part, positions, distinct slots), as a single call's time is the median
    of its repeats. On a shared machine another tenant's load makes a few of a run's hundreds of
    calls several times slower; a run's plain sum keeps them where a call's median does not
    (docs/calibration.md). The plain wall time per token is kept too."""
    decode = [r for r in run.records if min(r.positions) >= prompt_length]
    prefill_s = sum(r.wall_s for r in run.records if min(r.positions) < prompt_length)
    outside_calls_s = run.wall_s - prefill_s - sum(r.wall_s for r in decode)
    by_shape: dict[tuple, list[float]] = {}
    for r in decode:
        by_shape.setdefault((r.kind, len(r.positions), len(r.slot_contexts())), []).append(
            r.wall_s)
    calls_s = sum(len(times) * statistics.median(times) for times in by_shape.values())
    label = run.schedule + (f" d={run.draft_depth}" if run.draft_depth else "") + (
        f" k={run.block_length}" if run.block_length else "")
    return ValidationPoint(kind="run", model=name, spec=spec, label=label, group=run.schedule,
                           measured_s=(outside_calls_s + calls_s) / (run.tokens - 1),
                           wall_per_token_s=(run.wall_s - prefill_s) / (run.tokens - 1),
                           draft_depth=run.draft_depth, block_length=run.block_length,
                           prompt_length=prompt_length, tokens=run.tokens, depth=depth,
                           accept=run.accept)


class ValidationReport(BaseModel):
    median_rel_error: float
    max_rel_error: float
    per_schedule: dict[str, dict[str, float | int]]
    # the two figures calibration targets name: over the held-out calls, and over the runs'
    # decode time per token (AR, DtV and WFD together); None when the profile has none of them
    per_call: dict[str, float | int] | None = None
    per_token: dict[str, float | int] | None = None
    # the same two figures per execution mode, when the points come from more than one
    per_mode: dict[str, dict[str, dict[str, float | int] | None]] = {}
    # how far apart each held-out point's own measurements ran (slowest over fastest, less 1),
    # over the calls ("per_call") and the runs ("per_token"): an error near these is the
    # machine's noise in that hour, not the model's. None where the points were measured once
    # (profiles that predate repeats_s).
    repeat_spread: dict[str, dict[str, float | int] | None] = {}
    points: list[dict]


# the targets' two figures and the kind of point each is taken over ("calls", "runs" in a report)
FIGURES = (("per_call", "call"), ("per_token", "run"))


def _summary(values: list[float], name: str = "rel_error") -> dict[str, float | int] | None:
    if not values:
        return None
    magnitudes = np.abs(values)
    return {f"median_{name}": float(np.median(magnitudes)),
            f"max_{name}": float(magnitudes.max()), "points": len(magnitudes)}


def repeat_spread(points: list[ValidationPoint]) -> dict[str, dict[str, float | int] | None]:
    """Over the calls and the runs measured more than once: slowest over fastest, less 1."""
    return {figure: _summary([max(p.repeats_s) / min(p.repeats_s) - 1 for p in points
                              if p.kind == kind and p.repeats_s and len(p.repeats_s) > 1],
                             "spread")
            for figure, kind in FIGURES}


def report(points: list[ValidationPoint], hw: HardwareSpec, dtype: str) -> ValidationReport:
    rows = []
    for p in points:
        predicted = predict_point(p, hw, dtype)
        rows.append({"kind": p.kind, "model": p.model, "group": p.group, "label": p.label,
                     "mode": p.mode or hw.mode, "measured_s": p.measured_s,
                     "predicted_s": predicted, "rel_error": predicted / p.measured_s - 1})
    per = {group: _summary([r["rel_error"] for r in rows if r["group"] == group])
           for group in sorted({r["group"] for r in rows})}
    every = _summary([r["rel_error"] for r in rows])

    def by_kind(mode: str | None) -> dict[str, dict[str, float | int] | None]:
        """Over the calls and per token of the runs (of one mode, or all)."""
        mine = [r for r in rows if mode is None or r["mode"] == mode]
        return {figure: _summary([r["rel_error"] for r in mine if r["kind"] == kind])
                for figure, kind in FIGURES}

    modes = sorted({r["mode"] for r in rows})
    return ValidationReport(median_rel_error=every["median_rel_error"],
                            max_rel_error=every["max_rel_error"], per_schedule=per,
                            **by_kind(None),
                            per_mode={m: by_kind(m) for m in modes} if len(modes) > 1 else {},
                            repeat_spread=repeat_spread(points), points=rows)


def plot(rep: ValidationReport, path: str | Path, title: str) -> bool:
    """Measured against predicted, per group, on log axes; False without matplotlib."""

    def draw(fig) -> None:
        ax = fig.subplots()
        groups = sorted({r["group"] for r in rep.points})
        for i, g in enumerate(groups):
            mine = [r for r in rep.points if r["group"] == g]
            ax.scatter([r["measured_s"] * 1e3 for r in mine],
                       [r["predicted_s"] * 1e3 for r in mine], label=g, s=18, color=f"C{i}")
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in rep.points) * 1e3
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rep.points) * 1e3
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (ms: per call, or per token for runs)")
        ax.set_ylabel("predicted (ms)")
        ax.set_title(f"{title}\nheld out: median error {rep.median_rel_error:.1%}, "
                     f"max {rep.max_rel_error:.1%}", fontsize=9)
        ax.legend(fontsize=8)

    return save_figure(path, draw, (7, 6))
