"""`costmodel serving --fidelity steps` (costmodel.stream, costmodel.stream_vllm): the stream
served step by step, with this project's scheduling or vLLM's, and an idle engine's wake."""

import json

import numpy as np
import pytest
from conftest import bench_module, run_cli

from costmodel.engines import EngineOverheads, IdleWake
from costmodel.groups import block_calls_per_token
from costmodel.presets import resolve
from costmodel.requests import Lengths, Request, request_stream
from costmodel.schedules import AR, WFD, DtV
from costmodel.serving import Served, predict_serving, serve
from costmodel.stream import step_times

MODEL, HARDWARE = resolve("huginn-tiny", "a6000")
SCHEDULES = [AR(), DtV(draft_depth=2, block_length=3), WFD(draft_depth=2)]


# -- step by step (costmodel.stream) ------------------------------------------------------------

def test_a_lone_request_stepped_takes_its_prefill_then_a_step_per_token():
    """One request: its first token after its prompt's step (predict's prefill at batch 1,
    with the engine's step and its time for a prompt), each other token after a step priced at
    batch 1 and its context, the engine's request time before it all."""
    from costmodel.predict import prefill_time_s
    from costmodel.stream import step_times
    from costmodel.workload import Workload

    request = Request(arrival_s=1.0, prompt_tokens=40, output_tokens=9)
    engine = EngineOverheads(request_s=0.004, step_s=0.001, prompt_s=0.002)
    for schedule in SCHEDULES:
        served, mean_batch = serve(MODEL, HARDWARE, schedule, [request], max_batch=4,
                                   acceptance=0.7, depth=8, engine=engine, fidelity="steps")
        readouts = 2 if schedule.drafts else 1
        prefill = prefill_time_s(MODEL, HARDWARE, Workload(context_length=40, new_tokens=1),
                                 8, readouts)
        times = step_times(MODEL, HARDWARE, schedule, alpha=0.7, depth=8, kv_sharing=0,
                           dtype="bf16", max_batch=4, longest=49, engine=engine)
        assert served[0].ttft_s == pytest.approx(0.004 + prefill + 0.001 + 0.002, rel=1e-9)
        assert served[0].finish_s - served[0].first_token_s == pytest.approx(
            times[0, 41:49].sum(), rel=1e-9)
        assert mean_batch == pytest.approx(1.0)


def test_a_wake_is_interpolated_from_the_idle_times_measured():
    engine = EngineOverheads(wake=[IdleWake(idle_s=1.0, extra_s=0.010),
                                   IdleWake(idle_s=4.0, extra_s=0.040)])
    assert [engine.wake_s(t) for t in (0.0, 0.5, 1.0, 2.5, 4.0, 60.0)] == pytest.approx(
        [0.0, 0.005, 0.010, 0.025, 0.040, 0.040])
    with pytest.raises(ValueError, match="must rise"):
        EngineOverheads(wake=[IdleWake(idle_s=2.0, extra_s=0.0), IdleWake(idle_s=1.0,
                                                                          extra_s=0.0)])


@pytest.mark.parametrize("fidelity, budget", [("calls", None), ("steps", None),
                                              ("steps", 2048)])
def test_a_request_that_finds_the_engine_idle_waits_for_it_to_wake(fidelity, budget):
    """Two requests 3 s apart: the second finds the engine idle since the first finished and
    pays the wake for that long (its TTFT only: the engine's clock moves on by it); the first,
    at the engine's start, none. Call by call, step by step, and as vLLM schedules."""
    engine = EngineOverheads(wake=[IdleWake(idle_s=1.0, extra_s=0.010),
                                   IdleWake(idle_s=4.0, extra_s=0.040)])
    requests = [Request(arrival_s=0.0, prompt_tokens=32, output_tokens=16),
                Request(arrival_s=3.0, prompt_tokens=32, output_tokens=16)]
    kw = {"max_batch": 4, "acceptance": 0.7, "depth": 8, "fidelity": fidelity,
          "token_budget": budget}
    bare, _ = serve(MODEL, HARDWARE, AR(), requests, **kw)
    woken, _ = serve(MODEL, HARDWARE, AR(), requests, engine=engine, **kw)
    assert woken[0] == bare[0]
    assert woken[1].ttft_s - bare[1].ttft_s == pytest.approx(
        engine.wake_s(3.0 - bare[0].finish_s))
    assert woken[1].tpot_s == pytest.approx(bare[1].tpot_s)


@pytest.mark.parametrize("fidelity, budget", [("calls", None), ("steps", None),
                                              ("steps", 2048)])
def test_the_wake_lengthens_the_first_step_and_a_request_arriving_in_it_waits(fidelity, budget):
    """The engine takes a request in as it arrives and its first step after an idle runs the
    slower by the wake, as on the server: a request arriving 1 ms later, during that step,
    does not join it but waits for it to end (it joined the step when the wake delayed its
    start)."""
    engine = EngineOverheads(wake=[IdleWake(idle_s=1.0, extra_s=0.030)])
    requests = [Request(arrival_s=0.0, prompt_tokens=32, output_tokens=4),
                Request(arrival_s=3.0, prompt_tokens=32, output_tokens=4),
                Request(arrival_s=3.001, prompt_tokens=32, output_tokens=4)]
    served, _ = serve(MODEL, HARDWARE, AR(), requests, engine=engine, max_batch=4,
                      acceptance=0.7, depth=8, fidelity=fidelity, token_budget=budget)
    bare, _ = serve(MODEL, HARDWARE, AR(), requests[:2], max_batch=4, acceptance=0.7,
                    depth=8, fidelity=fidelity, token_budget=budget)
    assert served[1].ttft_s == pytest.approx(bare[1].ttft_s + 0.030)
    assert served[2].first_token_s > served[1].first_token_s + 1e-4


@pytest.mark.parametrize("fidelity, budget", [("calls", None), ("steps", None),
                                              ("steps", 2048)])
def test_the_engine_is_busy_for_its_time_on_a_prompt_not_for_a_request_s(fidelity, budget):
    """A lone request's TTFT is the same whether the engine's 10 ms are its time on the prompt
    (``prompt_s``) or the request's way in (``request_s``); a request arriving 1 ms later waits
    the longer by them in the first case only, the engine busy with the first one's prompt."""
    requests = [Request(arrival_s=0.0, prompt_tokens=32, output_tokens=8),
                Request(arrival_s=0.001, prompt_tokens=32, output_tokens=8)]
    kw = {"max_batch": 4, "acceptance": 0.7, "depth": 8, "fidelity": fidelity,
          "token_budget": budget}
    busy, _ = serve(MODEL, HARDWARE, AR(), requests, engine=EngineOverheads(prompt_s=0.010),
                    **kw)
    away, _ = serve(MODEL, HARDWARE, AR(), requests, engine=EngineOverheads(request_s=0.010),
                    **kw)
    assert busy[0].ttft_s == pytest.approx(away[0].ttft_s)
    assert busy[1].ttft_s - away[1].ttft_s == pytest.approx(0.010, rel=0.05)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_a_newcomer_during_a_prefill_is_prefilled_before_the_next_round(schedule):
    """Step by step, a request that arrives while another's prompt is prefilled is prefilled
    next, before the other's first round, as call by call, not once the other has finished."""
    requests = [Request(arrival_s=0.0, prompt_tokens=32, output_tokens=64),
                Request(arrival_s=1e-6, prompt_tokens=32, output_tokens=8)]
    kw = {"max_batch": 4, "acceptance": 0.7, "depth": 8}
    stepped, _ = serve(MODEL, HARDWARE, schedule, requests, fidelity="steps", **kw)
    called, _ = serve(MODEL, HARDWARE, schedule, requests, fidelity="calls", **kw)
    assert stepped[1].ttft_s < stepped[0].e2e_s / 4
    assert stepped[1].ttft_s == pytest.approx(called[1].ttft_s, rel=0.5)


@pytest.mark.parametrize("model, hardware", [("huginn-3.5b", "h200"),
                                             ("ouro-2.6b", "h100-sxm")])
def test_steps_agree_with_calls_on_a_stream_below_saturation(model, hardware):
    """A stream of 24 requests at 0.5/s: step by step, each schedule's TPOT median within 10%
    of the call-by-call simulation's, its throughput within 5% and its TTFT median within
    the prefill's spread (a DtV newcomer waits for a round, stepped for a token)."""
    spec, hw = resolve(model, hardware)
    stream = request_stream(0.5, 24, Lengths(low=256, high=1024), Lengths(low=64, high=160),
                            seed=0)
    calls = predict_serving(spec, hw, stream, max_batch=16)
    steps = predict_serving(spec, hw, stream, max_batch=16, fidelity="steps")
    for name, called in calls.items():
        stepped = steps[name]
        assert stepped.tpot_s.p50 == pytest.approx(called.tpot_s.p50, rel=0.10), name
        assert stepped.throughput_tokens_per_s == pytest.approx(
            called.throughput_tokens_per_s, rel=0.05), name
        assert stepped.ttft_s.p50 == pytest.approx(called.ttft_s.p50, rel=0.5), name


def test_a_wfd_batch_s_waves_read_out_out_of_phase():
    """Stepped, a batch of WFD waves pays a prelude and coda call on every tick where any wave's
    readout falls due, more than waves in step would; AR's and DtV's steps are in phase."""

    from costmodel.predict import _Pricer
    from costmodel.stream import _priced

    wfd = WFD(draft_depth=2)
    groups = wfd.call_groups(8)
    keys, batches = np.array([[100.0]]), np.array([[1.0], [8.0]])
    in_phase = _Pricer(MODEL, HARDWARE, "bf16", keys, batches, None).per_token(
        groups, np.asarray(0.7))["latency_s"]
    out_of_phase = _priced(MODEL, HARDWARE, wfd, groups, 0.7, "bf16", keys, batches)
    assert out_of_phase[0, 0] == pytest.approx(in_phase[0, 0])  # one wave: its own phase
    assert out_of_phase[1, 0] > in_phase[1, 0]


def test_the_command_steps_a_long_stream(capsys):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-3.5b", "--hardware", "h200",
                             "--requests", "3000", "--rate", "4/s", "--fidelity", "steps",
                             "--json")
    assert code in (0, None), err
    payload = json.loads(out)
    assert set(payload["schedules"]) == {"ar", "dtv", "wfd"}
    assert payload["schedules"]["wfd"]["requests"] == 3000


# -- vLLM's scheduling, step by step (costmodel.stream_vllm) -------------------------------------

def prefill_of(tokens: int, schedule) -> float:
    from costmodel.predict import prefill_time_s
    from costmodel.workload import Workload

    return prefill_time_s(MODEL, HARDWARE, Workload(context_length=tokens, new_tokens=1), 8,
                          2 if schedule.drafts else 1, readouts_together=True)  # the plugin's


def filling(schedule) -> int:
    """Tokens' time a wave's first step after its prompt takes, as vLLM schedules the plugin's
    waves (R block calls to a WFD wave's first readout at R; a DtV wave's first round; at
    acceptance 0.7 and R 8): AR's one."""
    if not schedule.fill_ticks(8):
        return 1
    ticks = float(block_calls_per_token(schedule.call_groups(8), np.asarray(0.7)))
    return round(schedule.fill_ticks(8) / ticks)


def times_at(schedule, batch: int = 1) -> np.ndarray:
    """A step's time at ``batch`` and each context (R 8, acceptance 0.7, bf16)."""
    return step_times(MODEL, HARDWARE, schedule, alpha=0.7, depth=8, kv_sharing=0,
                      dtype="bf16", max_batch=batch, longest=200,
                      engine=EngineOverheads())[batch - 1]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_a_lone_prompt_is_prefilled_in_chunks_of_the_token_budget(schedule):
    """A prompt of 150 tokens under a budget of 64 a step: three steps of chunks (64, 64, 22),
    its first token at the end of the third; then a token a step (a WFD wave's first step its
    pipeline filling: R block calls for its one token; a DtV wave's its first round, for the
    round's tokens)."""
    request = Request(arrival_s=0.0, prompt_tokens=150, output_tokens=6)
    served, _ = serve(MODEL, HARDWARE, schedule, [request], max_batch=2, acceptance=0.7,
                      depth=8, fidelity="steps", token_budget=64)
    assert served[0].ttft_s == pytest.approx(
        2 * prefill_of(64, schedule) + prefill_of(22, schedule), rel=1e-9)
    times = times_at(schedule)
    assert filling(WFD(draft_depth=2)) > 1
    first = round(schedule.tokens_per_round(0.7))  # the filling step's tokens
    assert served[0].finish_s - served[0].first_token_s == pytest.approx(
        times[150:150 + filling(schedule)].sum() + times[150 + first:155].sum(), rel=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_a_newcomer_beside_a_filling_wave_waits_for_its_r_block_calls(schedule):
    """As vLLM schedules: a request arriving while another's prompt is prefilled is prefilled in
    the next step, beside the other's first decoding step. A WFD wave's first step fills its
    pipeline (R block calls to its first readout at R), so the newcomer's first token comes
    after R block calls' worth of the other's tokens; a DtV wave's, after its first round's
    (its tokens commit at the round's end); beside AR, after one token; plus its own prefill
    less the pass over the weights the two share."""
    requests = [Request(arrival_s=0.0, prompt_tokens=32, output_tokens=64),
                Request(arrival_s=1e-6, prompt_tokens=32, output_tokens=8)]
    served, _ = serve(MODEL, HARDWARE, schedule, requests, max_batch=2, acceptance=0.7,
                      depth=8, fidelity="steps", token_budget=2048)
    assert filling(schedule) > 1 or schedule.name == "ar"
    assert served[1].first_token_s == pytest.approx(
        prefill_of(32, schedule) + times_at(schedule)[32:32 + filling(schedule)].sum()
        + prefill_of(32, schedule) - prefill_of(1, schedule), rel=1e-9)


def test_kv_taken_as_tokens_come_runs_out_and_preempts_the_newest():
    """A KV budget for about three requests' whole sequences and eight arriving together:
    vLLM's scheduling admits more than fit to the end, preempts when the cache runs out, and
    every request still finishes, its tokens all out; reserving whole sequences never
    preempts."""
    requests = [Request(arrival_s=0.0, prompt_tokens=30, output_tokens=40)] * 8
    per_token = MODEL.kv_bytes_per_token("bf16", 8, 0, 1)
    budget = 3 * (30 + 40) * per_token
    stats: dict = {}
    served, mean_batch = serve(MODEL, HARDWARE, AR(), requests, max_batch=8, acceptance=0.7,
                               depth=8, kv_budget=budget, fidelity="steps", token_budget=512,
                               stats=stats)
    assert stats["preemptions"] > 0 and mean_batch > 3
    for s in served:
        assert s.arrival_s < s.first_token_s < s.finish_s
    _, reserved_batch = serve(MODEL, HARDWARE, AR(), requests, max_batch=8, acceptance=0.7,
                              depth=8, kv_budget=budget, fidelity="steps")
    assert reserved_batch <= 3
    with pytest.raises(ValueError, match="request 0 .* needs"):
        serve(MODEL, HARDWARE, AR(), requests, max_batch=8, acceptance=0.7, depth=8,
              kv_budget=budget // 4, fidelity="steps", token_budget=512)
    with pytest.raises(ValueError, match="give fidelity steps"):
        serve(MODEL, HARDWARE, AR(), requests, max_batch=8, acceptance=0.7, depth=8,
              token_budget=512)


def test_the_command_schedules_as_vllm_and_counts_preemptions(capsys):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-3.5b", "--hardware",
                             "a6000", "--requests", "200", "--rate", "4/s", "--prompt-tokens",
                             "1024-2048", "--output-tokens", "256-1024", "--max-batch", "32",
                             "--fidelity", "steps", "--token-budget", "2048", "--schedule",
                             "ar", "--json")
    assert code in (0, None), err
    assert json.loads(out)["schedules"]["ar"]["preemptions"] > 0


@pytest.mark.parametrize("schedule, terms, step_by_step, exits", [
    ("ar", {"step_s": 0.003, "per_sequence_s": 0.0005}, False, None),
    ("wfd", {"step_s": 0.002, "tick_s": 0.0007, "wave_tick_s": 0.0003}, True, None),
    ("dtv", {"step_s": 0.003, "tick_s": 0.0006, "wave_tick_s": 0.0002}, False, None),
    # the plugin's exit mode: AR as waves, each sequence at its own depth (--exit)
    ("ar", {"step_s": 0.002, "tick_s": 0.0005, "wave_tick_s": 0.0002}, True,
     {"exit_depths": {2: 0.3, 3: 0.5, 5: 0.2}})])
def test_the_load_bench_recovers_an_engine_s_own_time_from_what_it_measures(schedule, terms,
                                                                             step_by_step, exits):
    """bench/serving_load.py's fit, given the TPOTs of lone requests, of two together and of a
    full batch, and the lone TTFT, that an engine with known own time makes (simulated, vLLM's
    scheduling), finds that time again: AR's per step and per sequence in a step; a drafting
    schedule's per tick, per wave in a tick and per step, the last from the pair alone (a lone
    wave's step commits up to commit_ahead + 1 tokens, one beside another's ends after R block
    calls) or with lone waves measured committing nothing ahead as well; and with the engine's
    own account of the lone requests (vLLM's queue and prefill times), its time on a prompt
    apart from the request's way in and out."""
    bench = bench_module("serving_load")
    prompt, output = Lengths.parse("16-64", "p"), Lengths.parse("32", "o")
    options = {"max_batch": 4, "dtype": "bf16", "names": [schedule], "seed": 0,
               "fidelity": "steps", "token_budget": 2048,
               **({"exits": exits, "continuous_depth": True} if exits else {})}
    known = EngineOverheads(request_s=0.004, prompt_s=0.006, **terms)
    engine_had = [0.0, 0]  # seconds, requests: the engine's account of those it finished

    def served(requests: list, seed: int, extra: dict | None = None) -> list:
        engine = known.model_copy(update=extra or {})  # {"commit_ahead": 0}: a step a token
        done = predict_serving(MODEL, HARDWARE, requests, engine=engine, keep_served=True,
                               **options)[schedule].served
        engine_had[0] += sum(s.ttft_s - known.request_s for s in done)
        engine_had[1] += len(done)
        return done

    measured = bench.engine_measurements(served, prompt, output, 4, repeats=1,
                                         step_by_step=step_by_step,
                                         engine_clock=lambda: tuple(engine_had))
    assert "pair_tpot_s" in measured and ("lone_step_tpot_s" in measured) == step_by_step
    fitted = bench.fit_engine(measured, MODEL, HARDWARE, prompt, output, options, 8)
    for field in (*terms, "request_s", "prompt_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(known, field), rel=0.02), field
    assert all(getattr(fitted, f) == 0 for f in ("step_s", "per_sequence_s", "tick_s",
                                                 "wave_tick_s") if f not in terms)


def test_the_load_bench_splits_no_ttft_where_the_engine_accounts_for_none():
    """An engine whose own account counts none of the lone requests (metrics gone, or another
    engine's): no way in and out is measured, and the fit keeps the whole missing TTFT per
    request."""
    bench = bench_module("serving_load")
    prompt, output = Lengths.parse("32", "p"), Lengths.parse("8", "o")

    options = {"max_batch": 2, "dtype": "bf16", "names": ["ar"], "seed": 0}

    def served(requests: list, seed: int, extra: dict | None = None) -> list:
        return predict_serving(MODEL, HARDWARE, requests, engine=EngineOverheads(request_s=0.01),
                               keep_served=True, **options)["ar"].served

    measured = bench.engine_measurements(served, prompt, output, 2, repeats=1,
                                         engine_clock=lambda: (0.0, 0))
    assert "lone_way_s" not in measured
    fitted = bench.fit_engine(measured, MODEL, HARDWARE, prompt, output, options, 8)
    assert fitted.prompt_s == 0 and fitted.request_s == pytest.approx(0.01, rel=0.02)


def test_the_load_bench_simulates_a_saved_run_again_without_a_server(tmp_path, monkeypatch,
                                                                      capsys):
    """`bench/serving_load.py --resimulate RUN.json`: a saved run's streams simulated again
    beside the measurements it kept, the engine's own time fitted again (from two requests
    together as well, where it measured them), its wake as saved, and its requests served
    together (`--together`) simulated again beside their measured TPOTs; a stream before which
    the engine was measured again (`--fit-each`) on its own fit."""
    import sys

    from costmodel.store import PROFILES_DIR

    bench = bench_module("serving_load")
    served = [{"arrival_s": t, "prompt_tokens": 40, "output_tokens": 32, "ttft_s": [0.03, 0.0],
               "tpot_s": [0.006, 0.0]} for t in (0.0, 0.2, 0.3, 1.5)]
    run = {"model": "huginn-tiny", "schedule": "wfd", "max_batch": 4, "commit_ahead": 8,
           "prompt_tokens": "16-64", "output_tokens": "32",
           "engine_measured": {"lone_tpot_s": 0.005, "lone_ttft_s": 0.03, "pair_tpot_s": 0.007,
                               "full_tpot_s": 0.008},
           "engine": {"wake": [{"idle_s": 1.0, "extra_s": 0.004}]},
           "together": [{"requests": n, "tpot_s": [t, 0.0]} for n, t in ((1, 0.005), (3, 0.0075))],
           "rows": [{"rate_per_s": 2.0, "requests": served},
                    {"rate_per_s": 2.0, "requests": served,  # measured again before it
                     "engine_measured": {"lone_tpot_s": 0.006, "lone_ttft_s": 0.03,
                                         "full_tpot_s": 0.010}}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    monkeypatch.setattr(sys, "argv", [
        "serving_load.py", "--profile", str(PROFILES_DIR / "cpu-huginn-fp32-quick.json"),
        "--resimulate", str(tmp_path / "run.json"), "--out", str(tmp_path / "again.json")])
    bench.main()
    printed = capsys.readouterr().out
    assert "ms a step" in printed and "4.0 ms after 1 s" in printed
    assert printed.count("own time") == 2  # the second stream's own fit
    assert "rate  2.00/s  TTFT p50    30.0 vs" in printed
    assert "3 together: TPOT p50   7.50 vs" in printed
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["engine"]["step_s"] + again["engine"]["tick_s"] > 0
    assert len(again["rows"][0]["requests"]) == 4
    # the lone, pair and full TPOTs fitted: a lone request simulated about as measured
    assert again["together"][0]["tpot_s"][1] == pytest.approx(0.005, rel=0.05)
    assert again["together"][1]["tpot_s"][1] > again["together"][0]["tpot_s"][1]
    assert again["rows"][0]["measured"]["tpot_s"]["p50"] == pytest.approx(0.006)
    first, second = (row["simulated"]["tpot_s"]["p50"] for row in again["rows"])
    assert second > first  # the same stream on the slower engine measured before it
    # a run saved by an older bench, or no run at all: one line, exit 2
    import runpy

    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in run.items()
                                                   if k != "engine_measured"}))
    (tmp_path / "torn.json").write_text('{"model": ')
    for name, said in (("old.json", "lacks engine_measured"), ("torn.json", "not a run's")):
        monkeypatch.setattr(sys, "argv", [
            "serving_load.py", "--profile", str(PROFILES_DIR / "cpu-huginn-fp32-quick.json"),
            "--resimulate", str(tmp_path / name)])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(bench.__file__, run_name="__main__")
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and len(err) == 1 and said in err[0], err


def test_the_load_bench_measures_the_wake_as_a_stream_meets_it():
    """bench/engine_fit.py's wake: a lone request arriving after each idle time (the engine
    idling until it arrives, as in a stream, so what it takes to start again is in its TTFT
    from that arrival), the idle times taken in turn, less one arriving at once."""
    bench = bench_module("engine_fit")
    known = EngineOverheads(wake=[IdleWake(idle_s=0.5, extra_s=0.004),
                                  IdleWake(idle_s=2.0, extra_s=0.010)])
    asked = []

    def serve(requests: list, seed: int) -> list:
        (request,) = requests
        asked.append(request.arrival_s)
        ttft = 0.020 + known.wake_s(request.arrival_s)
        return [Served(arrival_s=request.arrival_s, first_token_s=request.arrival_s + ttft,
                       finish_s=request.arrival_s + ttft + 0.1,
                       output_tokens=request.output_tokens)]

    lone = bench.lone_request(Lengths.parse("16-64", "p"), Lengths.parse("32", "o"), serve)
    wake = bench.wake_after_idle(lone, idles=(0.25, 1.0, 2.0), repeats=2)
    assert [w.idle_s for w in wake] == [0.25, 1.0, 2.0]
    assert [w.extra_s for w in wake] == pytest.approx([0.002, 0.006, 0.010])
    assert asked == [0.0, 0.25, 1.0, 2.0, 0.0] * 2


def test_the_load_bench_serves_each_kind_of_measurement_in_turn():
    """The engine's fit compares lone requests, pairs and full batches: each round serves
    every kind once, so a drift of the machine's speed during the fit falls on all alike."""
    bench = bench_module("engine_fit")
    asked = []

    def serve(requests: list, seed: int, extra: dict | None = None) -> list:
        asked.append((len(requests), seed, extra))
        return [Served(arrival_s=0.0, first_token_s=0.02, finish_s=0.1, output_tokens=9)
                for _ in requests]

    bench.engine_measurements(serve, Lengths.parse("32", "p"), Lengths.parse("9", "o"), 4,
                              repeats=2, step_by_step=True)
    assert asked == [(n, seed, extra) for seed in (0, 1)
                     for n, extra in ((1, None), (2, None), (4, None), (1, {"commit_ahead": 0}))]
