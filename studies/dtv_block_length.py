"""dtv-block-length: DtV speedup against its block length k for several acceptances, with the
best k marked, beside WFD (which has no k to tune)."""

from __future__ import annotations

from costmodel import predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, hardware_or_profile, workload

MODEL = "huginn-3.5b"


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hw = hardware_or_profile("a6000", profile)
    alphas = [0.6, 0.9] if small else [0.6, 0.7, 0.8, 0.9, 0.95, 0.98]
    ks = [1, 4, 16] if small else list(range(1, 33))
    rows = []
    for a in alphas:
        wl = workload(hw, acceptance=a)
        per_k = {k: predict(MODEL, hw, wl, block_length=k).schedules for k in ks}
        best = max(ks, key=lambda k: per_k[k]["dtv"].speedup_vs_ar)
        for k in ks:
            s = per_k[k]
            rows.append({"acceptance": a, "block_length": k,
                         "dtv_speedup": s["dtv"].speedup_vs_ar, "best_k": k == best,
                         "wfd_speedup": s["wfd"].speedup_vs_ar,
                         "draft_depth": s["wfd"].draft_depth})

    def draw(fig) -> None:
        ax = fig.subplots()
        for i, a in enumerate(alphas):
            mine = [r for r in rows if r["acceptance"] == a]
            color = f"C{i}"
            ax.plot([r["block_length"] for r in mine], [r["dtv_speedup"] for r in mine],
                    color=color, label=f"DtV, alpha={a}")
            best = next(r for r in mine if r["best_k"])
            ax.scatter([best["block_length"]], [best["dtv_speedup"]], color=color, zorder=3)
            ax.axhline(mine[0]["wfd_speedup"], color=color, linestyle="--", linewidth=1)
        ax.set_xlabel("DtV block length k (drafted tokens per round)")
        ax.set_ylabel("speedup over AR (x); dashed: WFD")
        ax.set_title(f"{MODEL} on {hw.name}: DtV must tune k, WFD need not")
        ax.legend(fontsize=7)

    return StudyResult("dtv-block-length", "DtV speedup vs block length", rows, draw)
