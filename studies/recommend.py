"""recommend: the fastest schedule and its parameters over hardware x acceptance curve x batch x
context, for the three real presets, as `costmodel recommend` chooses it (the quick search).

An acceptance curve is given by its acceptance a0 at the default draft depth d0 = ceil(R / 8) and
falls as the draft gets shallower: alpha(d) = 1 - (1 - a0) * d0 / d (deeper drafts agree more
with the full depth, as measured depth traces do)."""

from __future__ import annotations

from costmodel import recommend
from costmodel.hardware import HardwareSpec
from costmodel.memory import DoesNotFit
from costmodel.plans import default_draft_depth
from costmodel.presets import get_hardware, get_model

from .common import StudyResult, workload

MODELS = ["huginn-3.5b", "ouro-1.4b", "ouro-2.6b"]
HARDWARE = ["a6000", "h100-sxm", "rtx4090"]
CURVES = [0.7, 0.85, 0.94]
BATCHES = [1, 4, 16, 64]
CONTEXTS = [512, 4096]
NEW_TOKENS = 256
SYMBOL = {"ar": "AR", "dtv": "D", "wfd": "W"}


def acceptance_curve(depth: int, a0: float) -> dict[int, float]:
    d0 = default_draft_depth(depth)
    return {d: max(0.0, 1 - (1 - a0) * d0 / d) for d in range(1, depth)}


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hardware = [profile] if profile is not None else [get_hardware(h) for h in HARDWARE]
    hardware = hardware[:1] if small else hardware
    batches, contexts = ([1, 16], [512]) if small else (BATCHES, CONTEXTS)
    rows = []
    for model in MODELS[:2] if small else MODELS:
        depth = get_model(model).default_depth
        for hw in hardware:
            for a0 in CURVES:
                curve = acceptance_curve(depth, a0)
                for context in contexts:
                    for batch in batches:
                        wl = workload(hw, context_length=context, new_tokens=NEW_TOKENS,
                                      batch_size=batch)
                        row = {"model": model, "hardware": hw.name, "a0": a0,
                               "context": context, "batch": batch}
                        try:
                            best = recommend(model, hw, curve, wl, top=1, quick=True)[0]
                        except DoesNotFit:
                            rows.append({**row, "best": "does not fit"})
                            continue
                        rows.append({**row, "best": best.label, "schedule": best.schedule,
                                     "draft_depth": best.draft_depth,
                                     "block_length": best.block_length,
                                     "width_cap": best.width_cap,
                                     "speedup_vs_ar": best.speedup_vs_ar, "bound": best.bound})
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = list(dict.fromkeys(r["hardware"] for r in rows))

    def draw(fig) -> None:
        axes = fig.subplots(len(models), len(names), squeeze=False, sharex=True, sharey=True)
        colours = {"ar": "grey", "dtv": "C1", "wfd": "C0"}
        for i, model in enumerate(models):
            for j, name in enumerate(names):
                ax = axes[i][j]
                for r in rows:
                    if (r["model"], r["hardware"], r["context"]) != (model, name, contexts[0]):
                        continue
                    schedule = r.get("schedule")
                    text = "-" if schedule is None else SYMBOL[schedule] + (
                        f"{r['draft_depth']}" if r["draft_depth"] else "")
                    ax.text(r["batch"], r["a0"], text, ha="center", va="center", fontsize=8,
                            color=colours.get(schedule, "black"))
                ax.set_xscale("log", base=2)
                ax.set_xlim(min(batches) / 1.6, max(batches) * 1.6)
                ax.set_ylim(min(CURVES) - 0.06, max(CURVES) + 0.06)
                ax.set_title(f"{model}, {name}", fontsize=8)
                if i == len(models) - 1:
                    ax.set_xlabel("batch")
                if j == 0:
                    ax.set_ylabel("acceptance at d0")
        fig.suptitle(f"Fastest schedule (W: WFD, D: DtV, digit: draft depth), context "
                     f"{contexts[0]}", fontsize=9)

    winners = {}
    for r in rows:
        winners[r.get("schedule", "does not fit")] = winners.get(
            r.get("schedule", "does not fit"), 0) + 1
    return StudyResult("recommend", "The fastest schedule by hardware, acceptance, batch and "
                       "context", rows, draw, summary={"winners": winners})
