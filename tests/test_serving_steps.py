"""`costmodel serving --fidelity steps` (costmodel.stream, costmodel.stream_vllm): the stream
served step by step, with this project's scheduling or vLLM's, and an idle engine's wake."""

import json

import numpy as np
import pytest
from conftest import run_cli

from costmodel.engines import EngineOverheads, IdleWake
from costmodel.presets import resolve
from costmodel.requests import Lengths, Request, request_stream
from costmodel.schedules import AR, WFD, DtV
from costmodel.serving import predict_serving, serve

MODEL, HARDWARE = resolve("huginn-tiny", "a6000")
SCHEDULES = [AR(), DtV(draft_depth=2, block_length=3), WFD(draft_depth=2)]


# -- step by step (costmodel.stream) ------------------------------------------------------------

def test_a_lone_request_stepped_takes_its_prefill_then_a_step_per_token():
    """One request: its first token after its prompt's prefill (predict's, at batch 1), each
    other token after a step priced at batch 1 and its context, the engine's request time
    before it all."""
    from costmodel.predict import prefill_time_s
    from costmodel.stream import step_times
    from costmodel.workload import Workload

    request = Request(arrival_s=1.0, prompt_tokens=40, output_tokens=9)
    engine = EngineOverheads(request_s=0.004, step_s=0.001)
    for schedule in SCHEDULES:
        served, mean_batch = serve(MODEL, HARDWARE, schedule, [request], max_batch=4,
                                   acceptance=0.7, depth=8, engine=engine, fidelity="steps")
        readouts = 2 if schedule.drafts else 1
        prefill = prefill_time_s(MODEL, HARDWARE, Workload(context_length=40, new_tokens=1),
                                 8, readouts)
        times = step_times(MODEL, HARDWARE, schedule, alpha=0.7, depth=8, kv_sharing=0,
                           dtype="bf16", max_batch=4, longest=49, engine=engine)
        assert served[0].ttft_s == pytest.approx(0.004 + prefill, rel=1e-9)
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


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_a_lone_prompt_is_prefilled_in_chunks_of_the_token_budget(schedule):
    """A prompt of 150 tokens under a budget of 64 a step: three steps of chunks (64, 64, 22),
    its first token at the end of the third; then a token a step as without the budget."""
    request = Request(arrival_s=0.0, prompt_tokens=150, output_tokens=6)
    served, _ = serve(MODEL, HARDWARE, schedule, [request], max_batch=2, acceptance=0.7,
                      depth=8, fidelity="steps", token_budget=64)
    whole, _ = serve(MODEL, HARDWARE, schedule, [request], max_batch=2, acceptance=0.7,
                     depth=8, fidelity="steps")
    assert served[0].ttft_s == pytest.approx(
        2 * prefill_of(64, schedule) + prefill_of(22, schedule), rel=1e-9)
    assert served[0].finish_s - served[0].first_token_s == pytest.approx(
        whole[0].finish_s - whole[0].first_token_s, rel=1e-9)


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
