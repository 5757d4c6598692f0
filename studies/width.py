"""width: WFD speedup against width W (draft depth ceil(R / W)) and acceptance, for both models
on an RTX A6000 and an H100 SXM."""

from __future__ import annotations

from costmodel import get_hardware, predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, workload

MODELS = {"huginn-3.5b": 32, "ouro-2.6b": 4}
HARDWARE = ("a6000", "h100-sxm")


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hardware = [profile] if profile is not None else [get_hardware(h) for h in HARDWARE]
    alphas = [0.8, 1.0] if small else [0.7, 0.8, 0.9, 0.95, 1.0]
    rows = []
    for hw in hardware:
        for model, depth in MODELS.items():
            # the natural width of each draft depth d: W = ceil(R / d)
            widths = sorted({2, depth} if small else {-(-depth // d) for d in range(1, depth)})
            for a in alphas:
                for w in widths:
                    s = predict(model, hw, workload(hw, acceptance=a), width=w).schedules["wfd"]
                    rows.append({"hardware": hw.name, "model": model,
                                 "acceptance": a, "width": w, "draft_depth": s.draft_depth,
                                 "wfd_speedup": s.speedup_vs_ar,
                                 "block_calls_per_token": s.block_calls_per_token})

    def draw(fig) -> None:
        keys = sorted({(r["hardware"], r["model"]) for r in rows})
        axes = fig.subplots(1, len(keys), squeeze=False)[0]
        for ax, (hw, model) in zip(axes, keys, strict=True):
            for i, a in enumerate(alphas):
                mine = [r for r in rows if (r["hardware"], r["model"], r["acceptance"]) ==
                        (hw, model, a)]
                ax.plot([r["width"] for r in mine], [r["wfd_speedup"] for r in mine],
                        marker="o", color=f"C{i}", label=f"alpha={a}")
            ax.set_title(f"{model}, {hw}", fontsize=9)
            ax.set_xlabel("width W (positions in flight)")
        axes[0].set_ylabel("WFD speedup over AR (x)")
        axes[0].legend(fontsize=7)

    return StudyResult("width", "WFD speedup vs width and acceptance", rows, draw)
