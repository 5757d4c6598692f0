"""context: speedup against context length from 1k to 64k tokens, with recurrence-specific KV and
with sharing over 4 and 1 slots; where each stops fitting in memory, and the KV term's share of
WFD's per-token time."""

from __future__ import annotations

from costmodel import predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, hardware_or_profile, workload

MODELS = ["huginn-3.5b", "ouro-2.6b"]
SHARING = {0: "per depth", 4: "4 shared", 1: "1 shared"}


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hw = hardware_or_profile("h100-sxm", profile)
    contexts = [1024, 16384] if small else [1024 * 2**i for i in range(7)]
    rows = []
    for model in MODELS:
        for sharing, label in SHARING.items():
            for ctx in contexts:
                p = predict(model, hw, workload(hw, context_length=ctx, new_tokens=512,
                                                kv_sharing=sharing))
                wfd, dtv = p.schedules.get("wfd"), p.schedules.get("dtv")
                rows.append({
                    "model": model, "kv": label, "kv_sharing": sharing, "context": ctx,
                    "fits": p.memory.fits, "max_context": p.memory.max_context,
                    "wfd_speedup": wfd.speedup_vs_ar if wfd else None,
                    "dtv_speedup": dtv.speedup_vs_ar if dtv else None,
                    "wfd_kv_share": wfd.breakdown.kv_s / wfd.latency_per_token_s if wfd else None,
                })

    def draw(fig) -> None:
        axes = fig.subplots(1, len(MODELS), squeeze=False)[0]
        for ax, model in zip(axes, MODELS, strict=True):
            for i, label in enumerate(SHARING.values()):
                mine = [r for r in rows if r["model"] == model and r["kv"] == label]
                fit = [r for r in mine if r["fits"]]
                ax.plot([r["context"] for r in fit], [r["wfd_speedup"] for r in fit],
                        marker="o", color=f"C{i}", label=f"WFD, KV {label}")
                ax.plot([r["context"] for r in fit], [r["dtv_speedup"] for r in fit],
                        linestyle=":", color=f"C{i}")
                if len(fit) < len(mine):
                    ax.axvline(mine[0]["max_context"], color=f"C{i}", linestyle="--",
                               linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens); dashed: last that fits")
            ax.set_title(f"{model} on {hw.name}", fontsize=9)
        axes[0].set_ylabel("speedup over AR (x); dotted: DtV")
        axes[0].legend(fontsize=7)

    return StudyResult("context", "Speedup vs context length and KV sharing", rows, draw)
