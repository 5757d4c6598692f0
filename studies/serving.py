"""serving: a stream of requests through one engine (`costmodel serving`) at rising request
rates, for Huginn-3.5B and Ouro-2.6B on an H100 (or the profile's hardware): each schedule's TTFT
and TPOT percentiles, the share of requests meeting latency objectives (TTFT 1 s; TPOT 1.5x AR's
alone on that hardware) and goodput, the highest rate of the sweep at which each schedule keeps
them, and the rate at which WFD stops giving the shortest time per token. AR and DtV with an exit
rule ("ar exits", "dtv exits": the exit depths of the shipped tiny model's measured rule, stretched
to the model's R, its batch's tokens in step) are served step by step beside them (WFD with
exits has no closed form for a stream's steps)."""

from __future__ import annotations

from costmodel import get_model, predict
from costmodel.figures import latency_against_rate
from costmodel.hardware import HardwareSpec
from costmodel.requests import Lengths, request_stream
from costmodel.serving import predict_serving

from .adaptive_depth import MEASURED_RULE, measured_shape, scaled
from .common import StudyResult, hardware_or_profile, workload

MODELS = ["huginn-3.5b", "ouro-2.6b"]
TINY = {"huginn-3.5b": "huginn-tiny", "ouro-2.6b": "ouro-tiny"}  # whose measured exits shape
SCHEDULES = ("ar", "dtv", "wfd", "ar exits", "dtv exits")
TTFT_S = 1.0  # the time-to-first-token objective
TPOT_OVER_AR = 1.5  # the time-per-token objective: this times AR's alone on the hardware
RATES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
MAX_BATCH = 16
ATTAINMENT = 0.9


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    hw = hardware_or_profile("h100-sxm", profile)
    dtype = workload(hw).dtype
    rates = [0.5, 4.0] if small else RATES
    count = 12 if small else 100
    prompt = Lengths(low=64, high=128) if small else Lengths(low=256, high=1024)
    output = Lengths(low=16, high=32) if small else Lengths(low=64, high=256)
    rows, objectives = [], {}
    for model in MODELS:
        spec = get_model(model)
        alone = predict(spec, hw, workload(hw, context_length=round(prompt.mean),
                                           new_tokens=round(output.mean)))
        ttft, tpot = TTFT_S, TPOT_OVER_AR * alone.schedules["ar"].latency_per_token_s
        objectives[model] = {"ttft_s": ttft, "tpot_s": tpot}
        exits = {"exit_depths": exit_depths(TINY[model], spec.default_depth)}
        for rate in rates:
            stream = request_stream(rate, count, prompt, output, seed=0)
            results = predict_serving(spec, hw, stream, max_batch=MAX_BATCH, dtype=dtype,
                                      slo_ttft_s=ttft, slo_tpot_s=tpot)
            with_exits = predict_serving(spec, hw, stream, max_batch=MAX_BATCH, dtype=dtype,
                                         slo_ttft_s=ttft, slo_tpot_s=tpot, fidelity="steps",
                                         names=["ar", "dtv"], exits=exits)
            results.update({f"{name} exits": r for name, r in with_exits.items()})
            for name, r in results.items():
                rows.append({"model": model, "rate_per_s": rate, "schedule": name,
                             "mean_exit_depth": r.mean_exit_depth,
                             "options": r.options, "ttft_p50_s": r.ttft_s.p50,
                             "ttft_p99_s": r.ttft_s.p99, "tpot_p50_s": r.tpot_s.p50,
                             "tpot_p99_s": r.tpot_s.p99,
                             "tokens_per_s": r.throughput_tokens_per_s,
                             "mean_batch": r.mean_batch, "slo_attainment": r.slo_attainment,
                             "goodput_per_s": r.goodput_requests_per_s})
    summary = {"objectives": objectives, "requests": count, "max_batch": MAX_BATCH,
               "hardware": hw.name, **{model: summarize(rows, model) for model in MODELS}}

    def draw(fig) -> None:
        for ax, model in zip(fig.subplots(1, len(MODELS), squeeze=False)[0], MODELS,
                             strict=True):
            mine = [r for r in rows if r["model"] == model]
            points = {name: [(r["rate_per_s"], r["tpot_p50_s"], r["tpot_p99_s"])
                             for r in mine if r["schedule"] == name]
                      for name in SCHEDULES}
            latency_against_rate(ax, points, "time per output token (ms)",
                                 objectives[model]["tpot_s"],
                                 f"{model}, {hw.name}, at most {MAX_BATCH} together")

    return StudyResult("serving", "Serving latency against request rate", rows, draw, summary)


def exit_depths(tiny: str, depth: int) -> dict[int, float]:
    """The exit depths the tiny model's measured rule gives (``MEASURED_RULE``), stretched to
    R = ``depth`` at the same mean fraction of it."""
    shape = measured_shape(tiny)
    if shape is None:
        raise ValueError(f"{tiny} has no measured exits of {MEASURED_RULE[tiny]}")
    return scaled(shape, depth * sum(u * p for u, p in shape.items()), depth)


def summarize(rows: list[dict], model: str) -> dict:
    """Per schedule, the highest rate of the sweep whose requests met the objectives (at least
    ATTAINMENT of them); and the lowest rate at which WFD's median TPOT is not the shortest of
    the three schedules at full depth."""
    mine = [r for r in rows if r["model"] == model]
    kept = {name: max((r["rate_per_s"] for r in mine if r["schedule"] == name
                       and r["slo_attainment"] >= ATTAINMENT), default=None)
            for name in SCHEDULES}
    rates = sorted({r["rate_per_s"] for r in mine})

    def fastest(rate: float) -> str:
        return min((r for r in mine if r["rate_per_s"] == rate and r["mean_exit_depth"] is None),
                   key=lambda r: r["tpot_p50_s"])["schedule"]

    lead_ends = next((rate for rate in rates if fastest(rate) != "wfd"), None)
    return {"highest_rate_meeting_objectives_per_s": kept, "wfd_lead_ends_per_s": lead_ends}
