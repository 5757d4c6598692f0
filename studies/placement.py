"""placement: what N devices buy Huginn-3.5B and Ouro-2.6B (an H100 SXM's preset, or the
profile's GPU, in graphs mode), arranged four ways: N copies of the model (replication), the
model split over N (tensor parallelism, where its shapes allow N), and copies of the model
placed over devices of their own parts (P/R/C placement: prelude | block | coda, or prelude and
coda | block; ``costmodel.placement``). Per schedule and batch: one sequence's time per token
(WFD's placed copies pipelined across the wave) and the tokens a second of all N devices
(placed copies pipelined across requests), and which arrangement is best at each."""

from __future__ import annotations

from costmodel import get_model, predict
from costmodel.hardware import HardwareSpec
from costmodel.parallel import degree_works
from costmodel.placement import place

from .common import StudyResult, hardware_or_profile, workload

GPU_ONLY = "NVLink-joined GPUs in graphs mode"
MODELS = ["huginn-3.5b", "ouro-2.6b"]
DEVICES = [2, 3, 4, 5, 6, 8]
BATCHES = [1, 8]
SCHEDULES = ["ar", "wfd"]


def arrangements(model, hw, batch: int, devices: int, placed: dict) -> list[dict]:
    """(arrangement, schedule, ms per token of a sequence, tokens/s of the N devices) rows."""
    wl = workload(hw, batch_size=batch)
    one = predict(model, hw, wl).schedules
    rows = []
    for name in SCHEDULES:
        rows.append(("replicate", name, one[name].latency_per_token_s,
                     devices * one[name].tokens_per_s))
        if degree_works(model, devices):
            split = predict(model, hw, wl, tensor_parallel=devices).schedules[name]
            rows.append((f"tensor parallel {devices}", name, split.latency_per_token_s,
                         split.tokens_per_s))
        for layout, result in placed.items():
            copies = devices // result[name].devices
            if copies and result[name].fits:
                r = result[name]
                latency = min(r.latency_s, r.across_wave_latency_s or r.latency_s)
                rows.append((f"{copies} x {layout}", name, latency,
                             copies * batch / r.pipelined_latency_s))
    return [{"model": model.name, "batch": batch, "devices": devices, "arrangement": a,
             "schedule": s, "ms_per_token": t * 1e3, "tokens_per_s": tps}
            for a, s, t, tps in rows]


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hw = hardware_or_profile("h100-sxm", profile).in_mode("graphs")
    devices = [2, 3] if small else DEVICES
    rows = []
    for name in MODELS[:1] if small else MODELS:
        model = get_model(name)
        for batch in BATCHES:
            placed = {layout: place(model, hw, workload(hw, batch_size=batch), layout=layout)
                      for layout in ("pc|r", "p|r|c")}
            for n in devices:
                rows.extend(arrangements(model, hw, batch, n, placed))
    summary = {"hardware": hw.name, "best": best(rows)}

    def draw(fig) -> None:
        axes = fig.subplots(1, 2, squeeze=False)[0]
        mine = [r for r in rows if r["model"] == MODELS[0] and r["schedule"] == "wfd"]
        for ax, batch in zip(axes, BATCHES, strict=True):
            for arrangement in sorted({r["arrangement"].split(" x ")[-1].rstrip("0123456789 ")
                                       for r in mine}):
                points = [(r["devices"], r["tokens_per_s"]) for r in mine
                          if r["batch"] == batch and r["arrangement"].endswith(arrangement)]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=arrangement)
            ax.set_xlabel("devices")
            ax.set_ylabel("tokens/s, all devices")
            ax.set_title(f"{MODELS[0]} WFD, batch {batch}, {hw.name}", fontsize=8)
            ax.legend(fontsize=7)

    return StudyResult("placement", "Replication, tensor parallelism and P/R/C placement", rows,
                       draw, summary)


def best(rows: list[dict]) -> list[dict]:
    """Per (model, batch, devices, schedule): the arrangement with the shortest time per token
    and the one with the most tokens a second."""
    keys = sorted({(r["model"], r["batch"], r["devices"], r["schedule"]) for r in rows})
    out = []
    for model, batch, devices, schedule in keys:
        mine = [r for r in rows if (r["model"], r["batch"], r["devices"], r["schedule"])
                == (model, batch, devices, schedule)]
        out.append({"model": model, "batch": batch, "devices": devices, "schedule": schedule,
                    "fastest": min(mine, key=lambda r: r["ms_per_token"])["arrangement"],
                    "most_tokens": max(mine, key=lambda r: r["tokens_per_s"])["arrangement"]})
    return out
