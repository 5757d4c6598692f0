"""The engine's own time beside its model's calls, measured from what it serves and fitted to
the simulation: vLLM's (bench/serving_load.py, on the plugin's server) or this project's batch
path (bench/batch_load.py).

What is measured (``engine_measurements``): requests of the mean lengths served alone, one
after another, two arriving together, and a full batch of them arriving together, their median
TPOTs and the lone ones' median TTFT; for a drafting schedule also lone requests whose waves
commit nothing ahead (a step a token); and where the engine reports its own time on a request
(vLLM's queue and prefill times on /metrics), how much of the lone TTFT is the way in and out,
the engine free. The pair is there for the plugin's waves: a lone wave's step commits up to
``commit_ahead`` + 1 tokens, one beside another request's ends after R block calls, so from one
request to two the steps come several times as often per token, and the pair weighs vLLM's
time per step where the lone and full batch alone leave it to one measurement.
What is fitted (``fit_engine``): the terms of ``costmodel.engines.EngineOverheads`` that make
the simulation's figures the measured ones (in the least relative squares where there are more
figures than terms), through the simulation's own response to each.
The wake after an idle (``wake_after_idle``) is measured apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from costmodel.engines import EngineOverheads, IdleWake
from costmodel.requests import Lengths, Request
from costmodel.serving import Served, predict_serving


def mean_requests(prompt: Lengths, output: Lengths, together: int = 1) -> list[Request]:
    """``together`` requests of the mean lengths, arriving at once."""
    return [Request(arrival_s=0.0, prompt_tokens=round(prompt.mean),
                    output_tokens=round(output.mean))] * together


def served_together(measure, prompt: Lengths, output: Lengths, together: int, seeds,
                    *extra) -> list[Served]:
    """``together`` requests of the mean lengths arriving at once as ``measure(requests, seed,
    *extra)`` served them, once for each of ``seeds`` (its prompts another each time)."""
    requests = mean_requests(prompt, output, together)
    return [s for seed in seeds for s in measure(requests, seed, *extra)]


def median_tpot(served: list[Served]) -> float:
    return float(np.median([s.tpot_s for s in served]))


def simulated_together(spec, hw, engine: EngineOverheads, options: dict, prompt: Lengths,
                       output: Lengths, together: int) -> tuple[float, float]:
    """The simulated median TPOT and TTFT of ``together`` requests of the mean lengths arriving
    at once (``options``: ``predict_serving``'s, one schedule named)."""
    result = predict_serving(spec, hw, mean_requests(prompt, output, together), engine=engine,
                             **options)[options["names"][0]]
    return result.tpot_s.p50, result.ttft_s.p50


def lone_request(prompt: Lengths, output: Lengths,
                 serve: Callable[[list[Request], int], list[Served]]) -> Callable[[float], float]:
    """A lone request of the mean lengths served by ``serve`` (requests and a seed for their
    prompts: as served), arriving ``idle_s`` after its stream starts, its TTFT from that
    arrival: the engine idles meanwhile as it does in a stream (a server waits on its socket,
    the batch path sleeps until the arrival), so what it takes to start again is in the TTFT;
    each call's prompt another (no prefix cached)."""
    seeds = itertools.count(1000)

    def after(idle_s: float) -> float:
        (request,) = mean_requests(prompt, output)
        return serve([request.model_copy(update={"arrival_s": idle_s})], next(seeds))[0].ttft_s
    return after


def engine_text(engine: EngineOverheads, whose: str = "the engine's") -> str:
    ticks = (f"{engine.tick_s * 1e3:.2f} ms a tick, {engine.wave_tick_s * 1e3:.2f} ms a wave in "
             "it, " if engine.tick_s or engine.wave_tick_s else "")
    return (f"{whose} own time: {engine.step_s * 1e3:.2f} ms a step, "
            f"{engine.per_sequence_s * 1e3:.2f} ms a sequence in it, {ticks}"
            + (f"{engine.prompt_s * 1e3:.2f} ms a prompt's step, " if engine.prompt_s else "")
            + f"{engine.request_s * 1e3:.2f} ms a request" + wake_text(engine))


def engine_overheads(measure, spec, hw, prompt: Lengths, output: Lengths, options: dict,
                     commit_ahead: int, repeats: int = 3, in_process: bool = False
                     ) -> EngineOverheads:
    """An engine's own time beside its calls (``measure(requests, seed)``: the requests as it
    served them): ``fit_engine`` to ``engine_measurements``. ``in_process``: the engine is the
    caller's (this project's batch path), a request has no way in or out, and what a lone
    TTFT holds beyond the calls is all the engine's time on the prompt."""
    measured = engine_measurements(measure, prompt, output, options["max_batch"], repeats)
    if in_process:
        measured["lone_way_s"] = 0.0
    return fit_engine(measured, spec, hw, prompt, output, options, commit_ahead)


def engine_measurements(measure, prompt: Lengths, output: Lengths, batch: int,
                        repeats: int = 3, step_by_step: bool = False,
                        engine_clock: Callable[[], tuple[float, int]] | None = None
                        ) -> dict[str, float]:
    """Requests of the mean lengths as served (``measure(requests, seed)``): lone ones, one after
    another, two arriving together (where ``batch`` is more) and ``batch`` of them arriving
    together; their median TPOTs and the lone ones' median TTFT. ``step_by_step``: also lone
    ones whose waves commit nothing ahead (``measure(requests, seed, {"commit_ahead": 0})``), a
    step a token. ``engine_clock``: the engine's own account of the requests it finished
    (seconds queued and prefilling, summed, and how many), from which the lone ones' mean time
    on the way in and out, the engine not yet or no longer on them (``lone_way_s``). Each of
    the ``repeats`` rounds serves every kind once, in turn: the terms are fitted from how the
    kinds differ, so a drift of the machine's speed must fall on all of them alike."""
    # each kind by the median TPOT it measures: (requests together, measure's extra argument)
    kinds = {"lone_tpot_s": (1, ()), **({"pair_tpot_s": (2, ())} if batch > 2 else {}),
             "full_tpot_s": (batch, ()),
             **({"lone_step_tpot_s": (1, ({"commit_ahead": 0},))} if step_by_step else {})}
    served: dict[str, list[Served]] = {kind: [] for kind in kinds}
    engine_had = [0.0, 0]  # the engine's own account of the lone ones: seconds, requests
    for seed in range(repeats):
        for kind, (together, extra) in kinds.items():
            before = engine_clock() if engine_clock and kind == "lone_tpot_s" else None
            served[kind] += served_together(measure, prompt, output, together, [seed], *extra)
            if before is not None:
                after = engine_clock()
                engine_had = [engine_had[0] + after[0] - before[0],
                              engine_had[1] + after[1] - before[1]]
    lone = served["lone_tpot_s"]
    way = {}
    if engine_clock and engine_had[1] == len(lone):  # the engine's count is the lone ones'
        way = {"lone_way_s": max(0.0, float(np.mean([s.ttft_s for s in lone]))
                                 - engine_had[0] / len(lone))}
    return {**{kind: median_tpot(runs) for kind, runs in served.items()},
            "lone_ttft_s": float(np.median([s.ttft_s for s in lone])), **way}


def fit_engine(measured: dict[str, float], spec, hw, prompt: Lengths, output: Lengths,
               options: dict, commit_ahead: int) -> EngineOverheads:
    """The engine's own time that makes the simulation's TPOTs and lone TTFT the ``measured`` ones
    (``engine_measurements``): the terms, none below zero, that bring the simulated TPOTs to the
    measured in the least relative squares (exactly where there are as many as terms), through
    the simulation's own response to each (its times are linear in them); then from the lone
    TTFT the time per request or, where the engine said how long it had the lone ones
    (``lone_way_s``: the rest of their TTFT), that as the time per request and what the
    simulation's lone TTFT still lacks as the engine's time on a prompt, busy. AR's terms are
    its time per step and per sequence in a step. A drafting schedule's are per tick and per
    wave in a tick (the plugin's waves do their bookkeeping a tick at a time) and, where lone
    waves were measured committing nothing ahead, vLLM's own time per step: a lone wave's step
    commits up to ``commit_ahead`` + 1 tokens, one beside other requests ends after R block
    calls, so the steps come more often per token there; where two requests were measured
    together, vLLM's time per step is fitted from them as well (the same jump, from a lone
    wave's long steps to steps of R block calls)."""
    def simulated(together: int, engine: EngineOverheads) -> tuple[float, float]:
        return simulated_together(spec, hw, engine, options, prompt, output, together)

    from scipy.optimize import nnls

    bare, unit = EngineOverheads(commit_ahead=commit_ahead), 1e-3
    # (measurement, requests together, the engine as it served them)
    rows = [("lone_tpot_s", 1, bare), ("full_tpot_s", options["max_batch"], bare)]
    if "pair_tpot_s" in measured:
        rows.insert(1, ("pair_tpot_s", 2, bare))
    drafts = options["names"][0] != "ar" or bool(options.get("exits"))  # waves: exit mode
    if drafts and "lone_step_tpot_s" in measured:
        rows.append(("lone_step_tpot_s", 1, bare.model_copy(update={"commit_ahead": 0})))
    if not drafts:
        terms = ("step_s", "per_sequence_s")
    elif len(rows) > 2:
        terms = ("step_s", "tick_s", "wave_tick_s")
    else:
        terms = ("tick_s", "wave_tick_s")
    base = [simulated(n, engine)[0] for _, n, engine in rows]
    response = np.array([[(simulated(n, engine.model_copy(update={term: unit}))[0] - b) / unit
                          for term in terms] for (_, n, engine), b in zip(rows, base, strict=True)])
    # each row over its measurement: relative errors, the lone TPOT weighing as the full one's
    scale = np.array([1.0 / measured[name] for name, _, _ in rows])
    values, _ = nnls(response * scale[:, None], scale * np.array(
        [measured[name] - b for (name, _, _), b in zip(rows, base, strict=True)]))
    steps = bare.model_copy(update={t: float(v) for t, v in zip(terms, values, strict=True)})
    if "lone_way_s" in measured:  # the rest of the lone TTFT is the engine's, on the prompt
        way = measured["lone_way_s"]
        prompt_s = max(0.0, measured["lone_ttft_s"] - way - simulated(1, steps)[1])
        return steps.model_copy(update={"request_s": way, "prompt_s": prompt_s})
    request = max(0.0, measured["lone_ttft_s"] - simulated(1, steps)[1])
    return steps.model_copy(update={"request_s": request})


def wake_after_idle(lone_ttft: Callable[[float], float],
                    idles: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.0), repeats: int = 5
                    ) -> tuple[IdleWake, ...]:
    """An engine's extra TTFT for a lone request (``lone_ttft(idle)``: one arriving after the
    engine idled ``idle`` s, its TTFT) after each of ``idles``, over one arriving at once
    (medians of ``repeats``, the idle times taken in turn so that a drift of the machine's
    speed falls on all of them): its wake, which the simulation adds to a request that finds
    it idle. Streams of a few requests a second mostly find it idle for well under a second."""
    times: dict[float, list[float]] = {idle: [] for idle in (0.0, *idles)}
    for _ in range(repeats):
        for idle in (0.0, *idles, 0.0):  # the request at once twice a round
            times[idle].append(lone_ttft(idle))
    at_once = float(np.median(times[0.0]))
    return tuple(IdleWake(idle_s=idle, extra_s=max(0.0, float(np.median(times[idle]))
                                                    - at_once)) for idle in idles)


def wake_text(engine: EngineOverheads) -> str:
    """The wake measured, as a line's end."""
    wakes = ", ".join(f"{w.extra_s * 1e3:.1f} ms after {w.idle_s:g} s" for w in engine.wake)
    return f"; waking from idle: {wakes}" if wakes else ""
