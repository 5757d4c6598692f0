"""overhead: WFD speedup with a Python-heavy eager stack (the launch gap the paper-table study
derives from the WFD paper's AR figures), with the preset's eager prior (5 us per launch), with
CUDA graphs, and with no launch or host overhead at all: how much of WFD's gain is amortized
launch overhead and how much amortized weight reads."""

from __future__ import annotations

import math

from costmodel import Workload, predict
from costmodel.hardware import HardwareSpec

from .common import StudyResult, host_speed_sweep

MODELS = ["huginn-3.5b", "ouro-2.6b"]
GPU_ONLY = "a GPU's launch overhead and CUDA graphs"


def hardware_rows(hw: HardwareSpec, python_gap: float) -> list[dict]:
    """One row per model on ``hw``: AR's time and WFD's speedup with the Python-heavy stack's
    launch gap, in eager and graphs modes, and with no overhead at all."""
    variants = {"python-heavy": hw.with_terms(cuda_graphs=False,
                                              launch_overhead_s=python_gap),
                "eager": hw.in_mode("eager"),
                "cuda graphs": hw.in_mode("graphs"),
                # an infinitely fast host, and kernels that cost the device nothing
                "no overhead": hw.with_host_speed(math.inf).with_terms(kernel_device_s=0.0)}
    rows = []
    for model in MODELS:
        speed = {}
        for label, v in variants.items():
            s = predict(model, v, Workload()).schedules
            speed[label] = (s["wfd"].speedup_vs_ar, s["ar"].breakdown.overhead_s
                            / s["ar"].latency_per_token_s, s["ar"].latency_per_token_s)
        heavy = speed["python-heavy"][0]
        from_weights = math.log(speed["no overhead"][0]) / math.log(heavy) if heavy > 1 \
            else None
        rows.append({"hardware": hw.name, "model": model,
                     "launch_gap_python_heavy_us": python_gap * 1e6,
                     "ar_ms_python_heavy": speed["python-heavy"][2] * 1e3,
                     "ar_overhead_share_python_heavy": speed["python-heavy"][1],
                     "ar_ms_eager": speed["eager"][2] * 1e3,
                     "ar_ms_graphs": speed["cuda graphs"][2] * 1e3,
                     "wfd_speedup_python_heavy": heavy,
                     "wfd_speedup_eager": speed["eager"][0],
                     "wfd_speedup_graphs": speed["cuda graphs"][0],
                     "wfd_speedup_no_overhead": speed["no overhead"][0],
                     "gain_share_from_weights": from_weights})
    return rows


def draw(fig, rows: list[dict], sweep: list[dict]) -> None:
    """WFD's speedup in each overhead setting per model and device, and against host speed on
    the last device of the sweep."""
    ax, ax_host = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(rows))
    keys = ("wfd_speedup_python_heavy", "wfd_speedup_eager", "wfd_speedup_graphs",
            "wfd_speedup_no_overhead")
    for j, key in enumerate(keys):
        ax.bar([i + (j - 1.5) * 0.2 for i in x], [r[key] for r in rows], width=0.2,
               label=key.removeprefix("wfd_speedup_").replace("_", " "))
    ax.set_xticks(list(x), [f"{r['model']}\n{r['hardware']}" for r in rows], fontsize=7)
    ax.set_ylabel("WFD speedup over AR (x)")
    ax.set_title("How much of WFD's gain is launch overhead, how much weight reads",
                 fontsize=9)
    ax.legend(fontsize=7)
    shown = sweep[-1]["hardware"]  # the last device: the H200, or the profile's
    for i, model in enumerate(MODELS):
        for schedule, style in (("wfd", "-"), ("dtv", ":")):
            for mode, marker in (("eager", "o"), ("graphs", "s")):
                mine = [r for r in sweep if r["hardware"] == shown and r["model"] == model
                        and r["mode"] == mode]
                ax_host.plot([r["host_speed"] for r in mine],
                             [r[f"{schedule}_speedup"] for r in mine], linestyle=style,
                             marker=marker, markersize=3, color=f"C{i}",
                             label=f"{model} {schedule.upper()} {mode}")
    ax_host.axhline(1.0, color="grey", linewidth=0.8)
    ax_host.set_xscale("log", base=2)
    ax_host.set_xlabel("host speed (x the Python-heavy stack's)")
    ax_host.set_ylabel("speedup over AR (x)")
    ax_host.set_title(f"{shown}: speedup against host speed", fontsize=9)
    ax_host.legend(fontsize=6)


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    from costmodel.presets import get_hardware

    names = ["a6000"] if small else ["a6000", "h100-sxm", "h200"]
    hardware = [profile] if profile is not None else [get_hardware(n) for n in names]
    from .paper_table import derive_overhead

    # the host's launch gap is a property of the host and framework, derived once from the
    # paper's A6000 figures and carried to every device (with the presets' kernel counts, which
    # this study prices with)
    python_gap = derive_overhead(get_hardware("a6000"), kernels={})["launch_overhead_s"]
    rows = [row for hw in hardware for row in hardware_rows(hw, python_gap)]
    sweep = host_speed_sweep(hardware, MODELS, python_gap)
    return StudyResult("overhead", "WFD speedup with and without launch overhead", rows,
                       lambda fig: draw(fig, rows, sweep),
                       {"tables": {"Speedup against host speed (eager and CUDA graphs)": sweep}})
