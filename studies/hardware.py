"""hardware: AR, DtV and WFD per-token latency and speedup on every hardware preset, with the
term that bounds each (bandwidth, compute or overhead)."""

from __future__ import annotations

from costmodel import Workload, predict
from costmodel.specs import HardwareSpec

from .common import StudyResult, all_hardware

MODELS = ["huginn-3.5b", "ouro-2.6b"]


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    rows = []
    for hw in all_hardware(profile, small):
        for model in MODELS:
            p = predict(model, hw, Workload())
            s = p.schedules
            row = {"hardware": getattr(hw, "name", hw), "model": model, "fits": p.memory.fits}
            for key in ("ar", "dtv", "wfd"):
                r = s.get(key)
                row[f"{key}_ms_per_token"] = r.latency_per_token_s * 1e3 if r else None
                row[f"{key}_speedup"] = r.speedup_vs_ar if r else None
                row[f"{key}_bound"] = r.bound if r else None
            rows.append(row)

    def draw(fig) -> None:
        axes = fig.subplots(1, len(MODELS), squeeze=False)[0]
        for ax, model in zip(axes, MODELS, strict=True):
            mine = [r for r in rows if r["model"] == model and r["fits"]]
            x = range(len(mine))
            for j, key in enumerate(("ar", "dtv", "wfd")):
                ax.bar([i + (j - 1) * 0.27 for i in x], [r[f"{key}_ms_per_token"] for r in mine],
                       width=0.27, label=key.upper())
            ax.set_xticks(list(x), [r["hardware"] for r in mine], rotation=45, fontsize=7)
            ax.set_title(model)
            ax.set_ylabel("ms per token")
        axes[0].legend()

    return StudyResult("hardware", "AR, DtV and WFD across hardware", rows, draw)
