"""Exits in a stream (`costmodel serving --exit-depths ... --fidelity steps`): each token stops
at a depth drawn from the exits' distribution, a batch's tokens in step (this project's batch)
or each at its own depth (the plugin's exit mode on vLLM: continuous depth batching)."""

import json

import numpy as np
import pytest
from conftest import bench_module, run_cli

from costmodel.engines import EngineOverheads
from costmodel.predict import predict
from costmodel.presets import resolve
from costmodel.requests import Request
from costmodel.schedules import AR, DtV
from costmodel.serving import predict_serving
from costmodel.slots import readout_depths
from costmodel.stream import StreamExits, step_times

MODEL, HARDWARE = resolve("huginn-3.5b", "h100-sxm")
SHALLOW = {"exit_depths": {8: 0.5, 16: 0.5}}  # mean depth 12 of 32


def stream(rate: float, count: int = 40, seed: int = 0) -> list[Request]:
    gaps = np.random.default_rng(seed).exponential(1 / rate, count)
    return [Request(arrival_s=float(t), prompt_tokens=256, output_tokens=64)
            for t in np.cumsum(gaps)]


def apart(count: int = 4) -> list[Request]:
    """Requests that never overlap: each alone on the engine."""
    return [Request(arrival_s=100.0 * i, prompt_tokens=256, output_tokens=64)
            for i in range(count)]


def served(requests, exits=None, continuous=False, **options):
    return predict_serving(MODEL, HARDWARE, requests, max_batch=16, fidelity="steps",
                           exits=exits, continuous_depth=continuous, **options)


def test_a_lone_request_s_tokens_cost_what_predict_prices_with_the_same_exits():
    """Requests far apart: each token's step is predict's per-token latency at batch 1 with
    the same exit depths (its context aside: predict prices the generation's mean keys)."""
    for continuous in (False, True):
        out = served(apart(), SHALLOW, continuous, names=["ar", "dtv"])
        for name, result in out.items():
            alone = predict(MODEL, HARDWARE, {"context_length": 256, "new_tokens": 64,
                                              **SHALLOW}, continuous_depth=continuous)
            assert result.tpot_s.p50 == pytest.approx(
                alone.schedules[name].latency_per_token_s, rel=0.02)
            assert result.mean_exit_depth == pytest.approx(12.0)


def test_exits_shorten_a_lone_request_s_tokens_and_one_depth_stays_in_step_under_load():
    """Shallow exits cut a lone request's time per token. Under load, tokens that all stop at
    one depth run in step whether the engine batches depths continuously or not: the same
    calls, the same stream."""
    fixed = served(apart(), names=["ar"])["ar"].tpot_s.p50
    lone = served(apart(), SHALLOW, names=["ar"])["ar"].tpot_s.p50
    assert lone < 0.5 * fixed
    busy, one_depth = stream(4.0, count=80), {"exit_depths": {8: 1.0}}
    in_step = served(busy, one_depth, names=["ar"])["ar"]
    continuous = served(busy, one_depth, True, names=["ar"])["ar"]
    assert in_step.mean_batch > 4  # requests in flight together
    assert continuous.tpot_s == in_step.tpot_s and continuous.ttft_s == in_step.ttft_s


def test_a_step_with_exits_is_priced_from_its_own_batch_s_calls():
    """The step times' rows differ by batch as the exits' calls do: in step, a batch of 8
    runs nearly every depth for its deepest token, so its step costs more than batch 1's."""
    from costmodel.adaptive import ExitProfile

    profile = ExitProfile.from_distribution({8: 0.5, 16: 0.5}, 32, 0.8, False)
    times = step_times(MODEL, HARDWARE, AR(), alpha=0.8, depth=32, kv_sharing=0, dtype="bf16",
                       max_batch=8, longest=300, engine=EngineOverheads(),
                       exits=StreamExits(profile))
    fixed = step_times(MODEL, HARDWARE, AR(), alpha=0.8, depth=32, kv_sharing=0, dtype="bf16",
                       max_batch=8, longest=300, engine=EngineOverheads())
    assert times[0, 256] < 0.6 * fixed[0, 256]
    assert times[0, 256] < times[7, 256] < fixed[7, 256]


def test_a_token_holds_a_coda_slot_at_every_depth_it_may_stop_at():
    assert readout_depths(AR(), 8) == 1
    assert readout_depths(DtV(draft_depth=2, block_length=3), 8) == 2
    assert readout_depths(AR(), 8, exit_from=3) == 6  # 3..8
    assert readout_depths(DtV(draft_depth=2, block_length=3), 8, exit_from=3) == 7


def test_what_a_stream_with_exits_cannot_price_is_refused_in_one_line():
    requests = stream(1.0, count=4)
    with pytest.raises(ValueError, match="WFD with exits has no closed form"):
        served(requests, SHALLOW, names=["wfd"])
    with pytest.raises(ValueError, match="give fidelity steps"):
        predict_serving(MODEL, HARDWARE, requests, max_batch=4, exits=SHALLOW)
    assert set(served(requests, SHALLOW)) == {"ar", "dtv"}  # those with a closed form


def test_the_command_serves_a_stream_with_exits(tmp_path, capsys):
    from costmodel.trace import DepthRecord, TraceHeader, write_jsonl

    # with exits the stream is served step by step unless told otherwise
    common = ["serving", "--model", "huginn-3.5b", "--hardware", "h100-sxm", "--rate", "2/s",
              "--requests", "30"]
    code, out, err = run_cli(capsys, *common, "--exit-depths", "8:0.5,16:0.5", "--engine",
                             "vllm", "--token-budget", "2048", "--json")
    assert code == 0, err
    result = json.loads(out)["schedules"]
    assert set(result) == {"ar", "dtv"} and result["ar"]["mean_exit_depth"] == 12.0
    _, table, note = run_cli(capsys, *common, "--exit-depths", "8:0.5,16:0.5")
    assert "exits at mean depth 12.00" in table and "WFD with exits is left out" in note
    # a rule read from a measured depth trace: every depth's prediction is the final one's
    header = TraceHeader(trace="depths", source="measured", model="huginn-3.5b", device="cpu",
                         dtype="fp32", depth=32, prompt_length=10)
    records = [DepthRecord(position=10 + i, token=5, top1_prob=[0.5] * 32,
                           predictions=[5] * 32) for i in range(4)]
    path = tmp_path / "depths.jsonl"
    write_jsonl(path, header, records)
    code, out, err = run_cli(capsys, *common, "--exit", "argmax-stable:2", "--depth-trace",
                             str(path), "--schedule", "ar", "--json")
    assert code == 0, err
    assert json.loads(out)["schedules"]["ar"]["mean_exit_depth"] < 32
    for bad, message in [(["--exit-depths", "8:0.5,16:0.5", "--fidelity", "calls"],
                          "give fidelity steps"),
                         (["--exit", "kl:0.1"], "--exit is priced from the exit depths"),
                         (["--depth-trace", str(path)], "--depth-trace gives the exit depths"),
                         (["--exit-depths", "8:0.5,16:0.5", "--schedule", "wfd"],
                          "no closed form")]:
        code, _, err = run_cli(capsys, *common, *bad)
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1


def test_predict_prices_only_the_schedules_named_and_ar():
    """``predict(only=...)``: what a stream with exits asks of it (WFD with exits would be
    simulated, for nothing); AR always, the speedups' baseline."""
    full = predict(MODEL, HARDWARE, SHALLOW)
    some = predict(MODEL, HARDWARE, SHALLOW, only=["dtv"])
    assert set(full.schedules) == {"ar", "dtv", "wfd"} and set(some.schedules) == {"ar", "dtv"}
    assert some.schedules["dtv"] == full.schedules["dtv"]


def test_the_exit_bench_recovers_the_exit_mode_s_own_time_from_two_batches():
    """bench/depth_batching.py --fit-engine, given the tokens/s that an engine with known own
    time makes at two batches (vLLM's forward at fixed depth, the exit mode with a rule; here
    predicted with that time), finds the time again: per step and sequence from the first, per
    tick and wave in a tick from the second; and predicts a third batch with it."""
    from costmodel.profile import load_profile
    from costmodel.store import PROFILES_DIR

    depth_batching = bench_module("depth_batching")
    profile = load_profile(PROFILES_DIR / "cpu-huginn-fp32-quick.json")  # fp32
    known = EngineOverheads(step_s=0.0014, per_sequence_s=0.00006, tick_s=0.0002,
                            wave_tick_s=0.00015)
    exits = ("kl:0.01", [3] * 50 + [2] * 20 + [5] * 20 + [8] * 10)
    measured = {}
    for batch in (1, 8, 16):
        measured["fixed", batch] = depth_batching.predicted(profile, "huginn-tiny", batch, 128,
                                                            {}, engine=known).tokens_per_s
        measured["kl:0.01", batch] = depth_batching.predicted(
            profile, "huginn-tiny", batch, 128, {}, exits, known).tokens_per_s
    fitted = depth_batching.fitted_engine(profile, "huginn-tiny", *exits, measured, [8, 1],
                                          128, {})
    for field in ("step_s", "per_sequence_s", "tick_s", "wave_tick_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(known, field), rel=1e-6), field
    again = depth_batching.predicted(profile, "huginn-tiny", 16, 128, {}, exits, fitted)
    assert again.tokens_per_s == pytest.approx(measured["kl:0.01", 16], rel=1e-6)
