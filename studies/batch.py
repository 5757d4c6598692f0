"""batch: speedup against the number of sequences decoded together (one wave per sequence), up to
256: where WFD's advantage vanishes, and whether compute or the KV reads that grow with the batch
take it away. Memory capacity is lifted here (the ``fits`` column says whether the batch fits the
real card)."""

from __future__ import annotations

from costmodel import predict
from costmodel.figures import batch_speedup_axes
from costmodel.hardware import HardwareSpec

from .common import StudyResult, hardware_or_profile, workload

MODELS = ["huginn-3.5b", "ouro-2.6b"]
CONTEXT, NEW = 512, 256


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hw = hardware_or_profile("h100-sxm", profile)
    unbounded = hw.with_terms(memory_capacity_bytes=1e18)
    batches = [1, 64] if small else [2**i for i in range(9)]
    rows = []
    for model in MODELS:
        for b in batches:
            wl = workload(hw, context_length=CONTEXT, new_tokens=NEW, batch_size=b)
            p = predict(model, unbounded, wl)
            fits = predict(model, hw, wl).memory.fits
            s = p.schedules
            rows.append({"model": model, "batch": b, "fits": fits,
                         "ar_tokens_per_s": s["ar"].tokens_per_s,
                         "dtv_speedup": s["dtv"].speedup_vs_ar,
                         "wfd_speedup": s["wfd"].speedup_vs_ar,
                         "ar_bound": s["ar"].bound, "wfd_bound": s["wfd"].bound,
                         "wfd_kv_share": s["wfd"].breakdown.kv_s / s["wfd"].latency_per_token_s,
                         "wfd_compute_share": s["wfd"].breakdown.compute_s
                         / s["wfd"].latency_per_token_s})

    def draw(fig) -> None:
        ax = fig.subplots()
        for i, model in enumerate(MODELS):
            mine = [r for r in rows if r["model"] == model]
            ax.plot([r["batch"] for r in mine], [r["wfd_speedup"] for r in mine], marker="o",
                    color=f"C{i}", label=f"{model} WFD")
            ax.plot([r["batch"] for r in mine], [r["dtv_speedup"] for r in mine],
                    linestyle=":", color=f"C{i}", label=f"{model} DtV")
            ax.plot([r["batch"] for r in mine], [1 + r["wfd_kv_share"] for r in mine],
                    linestyle="--", color=f"C{i}", linewidth=0.8,
                    label=f"{model}: 1 + KV share of WFD time")
        batch_speedup_axes(ax, f"{hw.name}, context {CONTEXT}",
                           "speedup over AR at the same batch (x)", legend_size=7)

    return StudyResult("batch", "Speedup vs batch size", rows, draw)
