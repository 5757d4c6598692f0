"""`costmodel serving` (costmodel.serving): a stream of requests through one engine, simulated
call by call and priced by the cost model."""

import json

import numpy as np
import pytest
from conftest import bench_module, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.engines import EngineOverheads
from costmodel.presets import resolve
from costmodel.profile import load_profile
from costmodel.requests import Lengths, Request, read_requests, request_stream
from costmodel.schedules import AR, WFD, DtV
from costmodel.serving import highest_rate, predict_serving, serve, summarize
from costmodel.simulate import acceptance_draws, simulate_batch
from costmodel.store import PROFILES_DIR

MODEL, HARDWARE = resolve("huginn-tiny", "a6000")
SCHEDULES = [AR(), DtV(draft_depth=2, block_length=3), WFD(draft_depth=2)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_requests_far_apart_each_take_what_one_alone_takes(schedule):
    """Arrivals a minute apart: no request waits or shares a call, so each one's first token
    comes after its prefill, priced as one sequence's, and its other tokens take what the
    batch simulator gives that sequence alone."""
    requests = [Request(arrival_s=60.0 * i, prompt_tokens=20 + 5 * i, output_tokens=12)
                for i in range(3)]
    served, mean_batch = serve(MODEL, HARDWARE, schedule, requests, max_batch=4,
                               acceptance=0.7, depth=8, seed=5)
    assert mean_batch == pytest.approx(1.0)
    for i, (request, s) in enumerate(zip(requests, served, strict=True)):
        alone = simulate_batch(MODEL, HARDWARE, schedule, [(
            request.prompt_tokens, request.output_tokens,
            acceptance_draws(0.7, request.output_tokens + 64, 5 + i))], batch_size=1, depth=8)
        prefill = sum(r.wall_s for r, p in zip(alone.calls, alone.prefill, strict=True) if p)
        assert s.ttft_s == pytest.approx(prefill, rel=1e-9)
        assert s.finish_s - s.first_token_s == pytest.approx(alone.latency_s, rel=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_the_engine_s_own_time_is_paid_per_token_step_and_request(schedule):
    """The engine's time per committed token, whatever the schedule (a step committing one token
    of each sequence: commit_ahead 0): a lone request pays a step and its own share for the
    prefill's token (in its TTFT, after its way in) and for each of its other tokens; two
    together share each step and pay their own shares. With tokens committed ahead, a drafting
    schedule's tokens share a step nine ways; its block calls pay a tick each, AR none."""
    request = Request(arrival_s=0.0, prompt_tokens=20, output_tokens=10)
    engine = EngineOverheads(step_s=0.004, per_sequence_s=0.001, request_s=0.010,
                             commit_ahead=0)
    kw = {"max_batch": 2, "acceptance": 0.7, "depth": 8, "seed": 3}
    (bare,), _ = serve(MODEL, HARDWARE, schedule, [request], **kw)
    (paid,), _ = serve(MODEL, HARDWARE, schedule, [request], engine=engine, **kw)
    assert paid.ttft_s - bare.ttft_s == pytest.approx(0.010 + 0.005)
    assert (paid.finish_s - paid.first_token_s) - (bare.finish_s - bare.first_token_s) == \
        pytest.approx(9 * 0.005)
    if schedule.name == "ar":  # in step: a step commits a token of each, and pays both shares
        two_bare, _ = serve(MODEL, HARDWARE, schedule, [request] * 2, **kw)
        two, _ = serve(MODEL, HARDWARE, schedule, [request] * 2, engine=engine, **kw)
        assert two[0].tpot_s - two_bare[0].tpot_s == pytest.approx(0.004 + 2 * 0.001)
    ahead = engine.model_copy(update={"commit_ahead": 8, "request_s": 0.0})
    (shared,), _ = serve(MODEL, HARDWARE, schedule, [request], engine=ahead, **kw)
    share = 0.005 / (9 if schedule.drafts else 1)
    assert shared.finish_s - bare.finish_s == pytest.approx(10 * share)
    ticking = EngineOverheads(tick_s=0.001, wave_tick_s=0.0005)
    (ticked,), _ = serve(MODEL, HARDWARE, schedule, [request], engine=ticking, **kw)
    ticks = (ticked.finish_s - bare.finish_s) / 0.0015  # a tick of one wave each block call
    assert ticks == pytest.approx(round(ticks)) and (ticks >= 10 if schedule.drafts else
                                                     ticks == 0)


@pytest.mark.parametrize("schedule", SCHEDULES[1:], ids=lambda s: s.name)
def test_a_drafting_step_of_several_requests_is_shared_by_r_block_calls_worth(schedule):
    """Two requests together, a drafting schedule: a step commits several tokens of each (the
    plugin's commits ahead), but no more than its R block calls' worth; so a token's share of the
    engine's step is more than a ninth of it, and less than AR's whole share."""
    requests = [Request(arrival_s=0.0, prompt_tokens=20, output_tokens=40)] * 2
    kw = {"max_batch": 2, "acceptance": 0.9, "depth": 8, "seed": 3}
    bare, _ = serve(MODEL, HARDWARE, schedule, requests, **kw)
    paid, _ = serve(MODEL, HARDWARE, schedule, requests,
                    engine=EngineOverheads(step_s=0.004, commit_ahead=8), **kw)
    # 39 tokens after the first, each a half share of a step (two sequences), over its tokens
    per_token = (paid[0].finish_s - paid[0].first_token_s
                 - (bare[0].finish_s - bare[0].first_token_s)) / 39
    assert 0.002 / 9 < per_token < 0.002


def test_requests_that_arrive_together_queue_and_share_calls():
    """Twelve requests at once, four places: the batch fills (four sequences per call), the
    later ones wait for a place (their first tokens later), and the engine's rate exceeds one
    sequence's."""
    requests = [Request(arrival_s=0.0, prompt_tokens=16, output_tokens=24)] * 12
    served, mean_batch = serve(MODEL, HARDWARE, AR(), requests, max_batch=4, acceptance=0.7,
                               depth=8)
    assert 3.0 < mean_batch <= 4.0
    firsts = sorted(s.first_token_s for s in served)
    assert firsts[4] > firsts[3] and firsts[8] > firsts[7]  # three waves of four
    one, _ = serve(MODEL, HARDWARE, AR(), requests[:1], max_batch=4, acceptance=0.7, depth=8)
    total = max(s.finish_s for s in served)
    assert total < 12 * one[0].finish_s / 2  # batching serves them faster than one by one


def test_the_kv_budget_holds_back_what_does_not_fit():
    """A KV budget for two requests at a time: never more than two in a call, however many
    places the batch has; a request larger than the budget is refused in one line."""
    requests = [Request(arrival_s=0.0, prompt_tokens=30, output_tokens=10)] * 6
    per_token = MODEL.kv_bytes_per_token("bf16", 8, 0, 1)
    budget = 2 * (30 + 10) * per_token
    _, mean_batch = serve(MODEL, HARDWARE, AR(), requests, max_batch=6, acceptance=0.7,
                          depth=8, kv_budget=budget)
    assert 1.5 < mean_batch <= 2.0
    with pytest.raises(ValueError, match="request 0 .* needs"):
        serve(MODEL, HARDWARE, AR(), requests, max_batch=6, acceptance=0.7, depth=8,
              kv_budget=budget // 3)


@settings(max_examples=15, deadline=None)
@given(rate=st.floats(0.5, 500), seed=st.integers(0, 1000),
       schedule=st.sampled_from(SCHEDULES))
def test_a_stream_s_figures_are_consistent(rate, seed, schedule):
    requests = request_stream(rate, 8, Lengths(low=4, high=40), Lengths(low=2, high=16),
                              seed=seed)
    served, mean_batch = serve(MODEL, HARDWARE, schedule, requests, max_batch=3,
                               acceptance=0.6, depth=8, seed=seed)
    result = summarize(schedule, served, mean_batch, slo_ttft_s=0.01, slo_tpot_s=0.002)
    for s in served:
        assert s.arrival_s < s.first_token_s < s.finish_s
    for p in (result.ttft_s, result.tpot_s, result.e2e_s):
        assert p.p50 <= p.p90 <= p.p99
    assert 0 <= result.slo_attainment <= 1
    assert result.goodput_requests_per_s <= result.requests_per_s
    assert 1.0 - 1e-9 <= mean_batch <= 3.0 + 1e-9  # a ratio of sums of the same floats


def test_the_highest_rate_is_bracketed_then_bisected():
    assert highest_rate(lambda r: r <= 3.3) == pytest.approx(3.3, rel=2 ** -6)
    assert highest_rate(lambda r: r <= 3.3) <= 3.3
    assert highest_rate(lambda r: r <= 0.02, start_per_s=1.0) <= 0.02
    assert highest_rate(lambda r: False) is None


def test_more_load_means_longer_waits():
    lengths = Lengths(low=32, high=32), Lengths(low=32, high=32)
    light, heavy = (predict_serving(MODEL, HARDWARE, request_stream(rate, 40, *lengths),
                                    max_batch=4, names=["wfd"])["wfd"]
                    for rate in (1.0, 10_000.0))
    assert heavy.ttft_s.p50 > 5 * light.ttft_s.p50
    assert heavy.throughput_tokens_per_s > light.throughput_tokens_per_s


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_a_saturated_stream_holds_few_calls_and_prices_them_as_all_at_once(schedule,
                                                                           monkeypatch):
    """Far past saturation a drafting schedule's waves are seldom all between rounds (where a
    newcomer's admission settles the clock): the calls waiting to be priced are settled every
    SETTLE_EVERY of them, and priced a few at a time each request's times are those priced all
    at once (the engine's time with each call, first tokens and finishes marked)."""
    from costmodel import stream_calls

    held = []
    add = stream_calls._Clock.add

    def counting(clock, *args, **kwargs):
        add(clock, *args, **kwargs)
        held.append(len(clock.pending))

    requests = request_stream(10_000.0, 24, Lengths(low=8, high=40), Lengths(low=4, high=24),
                              seed=2)
    engine = EngineOverheads(step_s=1e-4, per_sequence_s=2e-5, tick_s=3e-5, wave_tick_s=1e-5,
                             prompt_s=2e-4)

    def times():
        served, _ = serve(MODEL, HARDWARE, schedule, requests, max_batch=4, acceptance=0.7,
                          depth=8, seed=5, engine=engine)
        return [t for s in served for t in (s.first_token_s, s.finish_s)]

    monkeypatch.setattr(stream_calls._Clock, "add", counting)
    whole = times()
    assert max(held) > 40
    monkeypatch.setattr(stream_calls, "SETTLE_EVERY", 7)
    held.clear()
    assert times() == pytest.approx(whole, rel=1e-12)
    assert max(held) <= 8


def test_each_request_served_call_by_call_is_counted_once_for_a_progress_bar():
    """``on_served``: the command's bar of requests served, every schedule's stream."""
    requests = request_stream(50.0, 9, Lengths(low=8, high=20), Lengths(low=4, high=12))
    served = []
    predict_serving(MODEL, HARDWARE, requests, max_batch=3, names=["ar", "wfd"],
                    on_served=lambda: served.append(1))
    assert len(served) == 2 * len(requests)


def test_a_requests_file_is_read_in_order_or_refused_by_line(tmp_path):
    good = tmp_path / "requests.jsonl"
    good.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 4}\n\n'
                    '{"arrival_s": 0.5, "prompt_tokens": 7, "output_tokens": 9}\n')
    assert [r.prompt_tokens for r in read_requests(good)] == [10, 7]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 4}\n'
                   '{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 4}\n')
    with pytest.raises(ValueError, match="line 2: prompt_tokens"):
        read_requests(bad)
    late = tmp_path / "late.jsonl"
    late.write_text('{"arrival_s": 2, "prompt_tokens": 1, "output_tokens": 2}\n'
                    '{"arrival_s": 1, "prompt_tokens": 1, "output_tokens": 2}\n')
    with pytest.raises(ValueError, match="order of arrival"):
        read_requests(late)


def test_the_command_prints_each_schedule_and_finds_the_rate(capsys):
    code, out, _ = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "30",
                           "--rate", "20/s", "--prompt-tokens", "16-48", "--output-tokens",
                           "16", "--max-batch", "4", "--slo-ttft", "20ms", "--slo-tpot",
                           "5ms", "--find-rate", "--schedule", "ar", "--schedule", "wfd",
                           "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report["schedules"]) == {"ar", "wfd"}
    for name, result in report["schedules"].items():
        assert result["requests"] == 30 and result["ttft_s"]["p99"] >= result["ttft_s"]["p50"]
        assert report["highest_rate_per_s"][name] is None or \
            report["highest_rate_per_s"][name] > 0
    assert report["rate_search_fidelity"] == "steps"  # the search's dozen streams: fast
    code, out, _ = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "10",
                           "--output-tokens", "8", "--max-batch", "2")
    assert code == 0 and "TTFT p50/p90/p99 ms" in out and "wfd --draft-depth" in out


@pytest.mark.parametrize("fidelity", ["calls", "steps"])
def test_each_request_as_served_is_written_and_makes_the_percentiles(capsys, tmp_path,
                                                                      fidelity):
    """--per-request: a JSON line per request, rate and schedule, in the stream's order (its
    arrivals), whose TTFTs and TPOTs are the ones the percentiles are taken over."""
    out_file = tmp_path / "served.jsonl"
    code, out, _ = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "12",
                           "--rates", "10/s,40/s", "--prompt-tokens", "16-48",
                           "--output-tokens", "8-16", "--max-batch", "4", "--fidelity",
                           fidelity, "--per-request", str(out_file), "--json")
    assert code == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(rows) == 2 * 3 * 12
    for run in json.loads(out)["sweep"]:
        stream = request_stream(run["rate_per_s"], 12, Lengths(low=16, high=48),
                                Lengths(low=8, high=16), seed=0)
        for name, result in run["schedules"].items():
            mine = [r for r in rows if r["rate_per_s"] == run["rate_per_s"]
                    and r["schedule"] == name]
            assert [(r["arrival_s"], r["prompt_tokens"], r["output_tokens"]) for r in mine] \
                == [(q.arrival_s, q.prompt_tokens, q.output_tokens) for q in stream]
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                assert np.percentile([r[key] for r in mine], 99) == pytest.approx(
                    result[key]["p99"]), (name, key)
            assert "served" not in result


@pytest.mark.parametrize("args, said", [
    (["--rate", "-2/s"], "request rate must be positive"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be N or LOW-HIGH"),
    (["--output-tokens", "9-3"], "--output-tokens must be N or LOW-HIGH"),
    (["--find-rate"], "--find-rate searches the rate"),
    (["--schedule", "beam"], "unknown schedule 'beam'"),
    (["--max-batch", "0"], "max batch must be at least 1"),
    (["--fidelity", "fast"], "unknown fidelity 'fast'; use calls or steps"),
    (["--fidelity", "steps", "--token-budget", "0"], "the token budget must be at least 1"),
    # requests longer than the model's context, or whose KV exceeds the memory left beside
    # the weights (Ouro-2.6B's context is 65,536 tokens)
    (["--prompt-tokens", "2000-2100"], "exceeds the model's context of 2048"),
    (["--model", "ouro-2.6b", "--prompt-tokens", "65000"],
     "the stream's mean request: 65,000 + 256 tokens"),
    (["--lengths", "azure-conv-2023", "--output-tokens", "9"], "leave out --prompt-tokens"),
    (["--lengths", "sharegpt"], "unknown length sample 'sharegpt'; shipped: azure-code-2023"),
])
def test_bad_input_is_one_line(capsys, args, said):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "3",
                             *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], err


def test_predict_adds_the_engine_s_time_to_every_token_as_overhead(capsys):
    """`predict --step-overhead --sequence-overhead --tick-overhead --wave-overhead
    --commit-ahead`: each schedule's tokens pay a step and each sequence's share, as overhead,
    a drafting schedule's shared by the tokens a step commits ahead and its one (with several
    sequences, no more than R block calls' worth), and its block calls a tick and each wave's
    share; throughput and speedups follow."""
    from costmodel import predict

    workload = {"context_length": 64, "new_tokens": 32, "batch_size": 2}
    bare = predict("huginn-tiny", "a6000", workload).schedules
    engine = EngineOverheads(step_s=0.005, per_sequence_s=0.001, tick_s=0.0002,
                             wave_tick_s=0.0001, commit_ahead=3)
    prediction = predict("huginn-tiny", "a6000", workload, engine=engine)
    paid = prediction.schedules
    for name, result in paid.items():
        drafts = name != "ar"
        calls = bare[name].block_calls_per_token
        # a step of two sequences ends after R block calls: R / calls tokens, where fewer than 4
        tokens = min(4, prediction.depth / calls)
        own = 0.007 / tokens + 0.0004 * calls if drafts else 0.007
        assert result.latency_per_token_s == pytest.approx(bare[name].latency_per_token_s + own)
        assert result.breakdown.overhead_s == pytest.approx(bare[name].breakdown.overhead_s
                                                            + own)
        assert result.tokens_per_s == pytest.approx(2 / result.latency_per_token_s)
        assert result.speedup_vs_ar == pytest.approx(
            paid["ar"].latency_per_token_s / result.latency_per_token_s)
    code, out, _ = run_cli(capsys, "predict", "--model", "huginn-tiny", "--batch", "2",
                           "--context", "64", "--new-tokens", "32", "--step-overhead", "5ms",
                           "--sequence-overhead", "1ms", "--tick-overhead", "0.2ms",
                           "--wave-overhead", "0.1ms", "--commit-ahead", "3", "--json")
    assert code == 0
    assert json.loads(out)["schedules"]["wfd"]["latency_per_token_s"] == pytest.approx(
        paid["wfd"].latency_per_token_s)
    code, _, err = run_cli(capsys, "predict", "--step-overhead", "-1ms")
    assert code == 2 and "duration must be positive" in err, err


def test_serving_takes_the_engine_s_time_on_prompts_and_on_the_way(capsys):
    """`serving --prompt-overhead --request-overhead`: a lone request's TTFT pays both (the
    first in its prompt's step, the second before the engine has it); a bad duration is one
    line."""
    args = ["serving", "--model", "huginn-tiny", "--requests", "1", "--output-tokens", "4",
            "--schedule", "ar", "--fidelity", "steps", "--json"]

    def ttft(*extra: str) -> float:
        code, out, err = run_cli(capsys, *args, *extra)
        assert code == 0, err
        return json.loads(out)["schedules"]["ar"]["ttft_s"]["p50"]

    assert ttft("--prompt-overhead", "10ms", "--request-overhead", "5ms") == pytest.approx(
        ttft() + 0.015)
    code, _, err = run_cli(capsys, *args, "--prompt-overhead", "-1ms")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "positive" in err, err


def test_a_sweep_of_rates_gives_a_table_each_and_a_figure(capsys, tmp_path):
    figure = tmp_path / "latency.png"
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "12",
                             "--output-tokens", "8", "--max-batch", "2", "--rates",
                             "2/s,20/s,200/s", "--plot", str(figure), "--schedule", "wfd",
                             "--json")
    assert code == 0, err
    sweep = json.loads(out)["sweep"]
    assert [run["rate_per_s"] for run in sweep] == [2.0, 20.0, 200.0]
    waits = [run["schedules"]["wfd"]["ttft_s"]["p50"] for run in sweep]
    assert waits == sorted(waits)  # more load, longer waits for a place
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--plot",
                           str(figure))
    assert code == 2 and "--plot needs two rates or more" in err


@pytest.mark.parametrize("fidelity", ["calls", "steps"])
@pytest.mark.parametrize("schedule", [AR(), DtV(draft_depth=4, block_length=6)],
                         ids=lambda s: s.name)
def test_a_newcomer_mid_round_starts_its_prefill_at_the_next_call(schedule, fidelity):
    """`wfd`'s batch path admits a request that has arrived before any call, mid-round too, and
    its prefill runs first: beside a running request its first token comes about its lone
    prefill's time after its arrival, not after the rest of the running round (Huginn-3.5B's
    AR round is 34 calls; a DtV round several times that)."""
    model, hw = resolve("huginn-3.5b", "h100-sxm")
    kw = {"max_batch": 4, "acceptance": 0.8, "depth": 32, "seed": 1, "fidelity": fidelity}
    first = Request(arrival_s=0.0, prompt_tokens=256, output_tokens=64)
    (running,), _ = serve(model, hw, schedule, [first], **kw)
    round_s = (running.finish_s - running.first_token_s) / 63 * schedule.tokens_per_round(0.8)
    arrives = running.first_token_s + 0.4 * round_s  # well inside a round
    newcomer = Request(arrival_s=arrives, prompt_tokens=128, output_tokens=16)
    (lone,), _ = serve(model, hw, schedule, [newcomer.model_copy(update={"arrival_s": 0.0})],
                       **kw)
    _, beside = serve(model, hw, schedule, [first, newcomer], **kw)[0]
    assert lone.ttft_s * (1 - 1e-9) <= beside.ttft_s < lone.ttft_s + 0.1 * round_s


def test_pricing_the_calls_in_runs_admits_as_pricing_each_call_would(monkeypatch):
    """The call-by-call stream prices its calls in runs and checks the next arrival before each
    call against a bound on the calls not yet priced: every request is admitted where checking
    the priced time before every call admits it (Ouro's small prelude and coda calls are priced
    first, its block calls far longer; an engine's own time rides on some calls)."""
    from costmodel import stream_calls

    profile = load_profile(PROFILES_DIR / "cpu-huginn-fp32-quick.json")
    cases = [("ouro-2.6b", resolve("ouro-2.6b", "a6000")[1], "64-512", 2.0, {}),
             ("huginn-tiny", profile.hardware, "16-64", 8.0, {"dtype": "fp32", "engine": (
                 EngineOverheads(step_s=0.002, per_sequence_s=4e-4, tick_s=3e-4,
                                 wave_tick_s=2e-4, prompt_s=0.005))})]
    for name, hw, prompts, rate, options in cases:
        model = resolve(name, "a6000")[0]
        requests = request_stream(rate, 30, Lengths.parse(prompts, "p"),
                                  Lengths.parse("32", "o"), seed=3)
        bounded = predict_serving(model, hw, requests, max_batch=8, keep_served=True, **options)
        with monkeypatch.context() as patched:
            patched.setattr(stream_calls._Clock, "passed",
                            lambda clock, time: time <= clock.now or time <= clock.settle())
            each = predict_serving(model, hw, requests, max_batch=8, keep_served=True,
                                   **options)
        for schedule, result in bounded.items():
            for a, b in zip(result.served, each[schedule].served, strict=True):
                assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-12)
                assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-12)


def test_the_batch_path_load_bench_measures_and_simulates_the_same_stream(tmp_path, monkeypatch):
    """bench/batch_load.py end to end at a tiny size (its wake left out: half a minute of
    idles): the batch path's own time fitted, a stream decoded by `wfd`'s batch path and
    simulated beside it, each request kept with both its figures."""
    bench = bench_module("batch_load")
    out = tmp_path / "load.json"
    monkeypatch.setattr("sys.argv", [
        "batch_load.py", "--profile", str(PROFILES_DIR / "cpu-huginn-fp32-quick.json"),
        "--schedule", "wfd", "--rates", "40", "--requests", "3", "--prompt-tokens", "8",
        "--output-tokens", "4", "--max-batch", "2", "--no-wake", "--out", str(out)])
    bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rate_per_s"] == 40 and 0 < row["acceptance"] <= 1
    for figures in (row["measured"], row["simulated"]):
        assert all(value > 0 for value in figures.values())
    assert len(row["requests"]) == 3
    assert all(len(r["ttft_s"]) == 2 and len(r["tpot_s"]) == 2 for r in row["requests"])
