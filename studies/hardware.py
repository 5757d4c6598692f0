"""hardware: AR, DtV and WFD per-token latency and speedup on every hardware preset, with the
term that bounds each (bandwidth, compute or overhead), and each schedule's speedup as the host
gets faster (eager and CUDA graphs, from each device's own host terms)."""

from __future__ import annotations

from costmodel import predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, all_hardware, host_speed_sweep, workload

MODELS = ["huginn-3.5b", "ouro-2.6b"]


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    rows = []
    for hw in all_hardware(profile, small):
        for model in MODELS:
            p = predict(model, hw, workload(hw))
            s = p.schedules
            row = {"hardware": hw.name, "model": model, "fits": p.memory.fits}
            for key in ("ar", "dtv", "wfd"):
                r = s.get(key)
                row[f"{key}_ms_per_token"] = r.latency_per_token_s * 1e3 if r else None
                row[f"{key}_speedup"] = r.speedup_vs_ar if r else None
                row[f"{key}_bound"] = r.bound if r else None
            rows.append(row)

    hardware = all_hardware(profile, small)
    sweep = host_speed_sweep(hardware, MODELS)

    def draw(fig) -> None:
        axes, host_axes = fig.subplots(2, len(MODELS), squeeze=False)
        for ax, model in zip(host_axes, MODELS, strict=True):
            for i, name in enumerate(dict.fromkeys(r["hardware"] for r in sweep)):
                for schedule, style in (("wfd", "-"), ("dtv", ":")):
                    mine = [r for r in sweep if r["hardware"] == name and r["model"] == model
                            and r["mode"] == "eager"]
                    ax.plot([r["host_speed"] for r in mine], [r[f"{schedule}_speedup"]
                                                             for r in mine],
                            linestyle=style, color=f"C{i % 10}", linewidth=1,
                            label=f"{name} {schedule.upper()}" if model == MODELS[0] else None)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("host speed (x the device's eager host terms)", fontsize=8)
            ax.set_ylabel("speedup over AR (x)", fontsize=8)
        host_axes[0].legend(fontsize=5, ncol=2)
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

    return StudyResult("hardware", "AR, DtV and WFD across hardware", rows, draw,
                       {"tables": {"Speedup against host speed (eager and CUDA graphs)": sweep}})
