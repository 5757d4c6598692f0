"""memory: the longest sequence (prompt + generated) whose KV fits beside the weights, for each
model, hardware preset and KV sharing, at batch 1 and bf16 (a CPU profile: its fp32), DtV/WFD
readout slots counted."""

from __future__ import annotations

from costmodel import predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, all_hardware, workload
from .context import SHARING

MODELS = ["huginn-3.5b", "ouro-1.4b", "ouro-2.6b"]


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    rows = []
    for hw in all_hardware(profile, small):
        for model in MODELS:
            row = {"hardware": hw.name, "model": model}
            for sharing, label in SHARING.items():
                p = predict(model, hw, workload(hw, context_length=1, new_tokens=1,
                                                kv_sharing=sharing))
                row[f"max_context_kv_{label.replace(' ', '_')}"] = p.memory.max_context
            rows.append(row)

    def draw(fig) -> None:
        axes = fig.subplots(1, len(MODELS), squeeze=False)[0]
        for ax, model in zip(axes, MODELS, strict=True):
            mine = [r for r in rows if r["model"] == model]
            x = range(len(mine))
            for j, label in enumerate(SHARING.values()):
                key = f"max_context_kv_{label.replace(' ', '_')}"
                ax.bar([i + (j - 1) * 0.27 for i in x], [max(r[key], 1) for r in mine],
                       width=0.27, label=f"KV {label}")
            ax.set_yscale("log")
            ax.set_xticks(list(x), [r["hardware"] for r in mine], rotation=45, fontsize=7)
            ax.set_title(model)
        axes[0].set_ylabel("longest sequence that fits (tokens)")
        axes[0].legend(fontsize=7)

    return StudyResult("memory", "Longest context that fits", rows, draw)
