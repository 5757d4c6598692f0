"""Closed forms against the event simulator, and the limits the design promises."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel import AR, WFD, DtV, Workload, get_hardware, get_model, predict, simulate
from costmodel.groups import block_calls_per_token
from costmodel.predict import _Pricer

HUGINN = get_model("huginn-3.5b")
A6000 = get_hardware("a6000")


def closed_form(model, hw, schedule, alpha, context, new_tokens, kv_sharing=0):
    depth = model.default_depth
    pricer = _Pricer(model, hw, "bf16", np.asarray(context + (new_tokens - 2) / 2),
                     np.asarray(1.0), None)
    groups = schedule.call_groups(depth, kv_sharing)
    totals = pricer.per_token(groups, np.asarray(alpha))
    return float(totals["latency_s"]), float(block_calls_per_token(groups, np.asarray(alpha)))


schedules = st.one_of(
    st.builds(lambda d: WFD(draft_depth=d), st.integers(1, 31)),
    st.builds(lambda d, w: WFD(draft_depth=d, width_cap=w), st.integers(1, 31),
              st.integers(1, 12)),
    st.builds(lambda k, d: DtV(block_length=k, draft_depth=d), st.integers(1, 8),
              st.integers(1, 31)),
)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(schedules, st.floats(0.0, 1.0), st.sampled_from([0, 1, 4]), st.integers(0, 2**16))
def test_simulator_mean_agrees_with_closed_form(schedule, alpha, sharing, seed):
    model = get_model("ouro-2.6b") if seed % 2 else HUGINN
    if model.default_depth <= schedule.draft_depth:
        schedule = schedule.model_copy(update={"draft_depth": model.default_depth - 1})
    new_tokens = 800
    # without records: the same prices (test_simulating_without_records_prices_the_same)
    sims = [simulate(model, A6000, schedule, context_length=2048, new_tokens=new_tokens,
                     acceptance=alpha, seed=seed + i, kv_sharing=sharing, records=False)
            for i in range(3)]
    sim_latency = np.mean([s.latency_per_token_s for s in sims])
    sim_calls = np.mean([s.block_calls / s.committed_tokens for s in sims])
    latency, calls = closed_form(model, A6000, schedule, alpha, 2048, new_tokens, sharing)
    # sampling error of a renewal process over ~800 tokens, plus the end of the last wave: over
    # 450 random configurations (bench/simulator_vs_closed_form.py, seeds 1 and 2) the 99th
    # percentile was 4.5% and the worst 7.5%
    assert sim_calls == pytest.approx(calls, rel=0.08, abs=0.05)
    assert sim_latency == pytest.approx(latency, rel=0.08)


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5, 8, 16, 31])
def test_wfd_at_full_acceptance_takes_d_block_calls_per_token(d):
    groups = WFD(draft_depth=d).call_groups(32)
    assert float(block_calls_per_token(groups, np.asarray(1.0))) == pytest.approx(d)
    sim = simulate(HUGINN, A6000, WFD(draft_depth=d), context_length=64, new_tokens=801,
                   acceptance=1.0)
    # the wave's ramp-up costs R - d extra ticks once
    assert sim.block_calls == 800 * d + (32 - d)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.9, 1.0])
def test_wfd_block_calls_closed_form(alpha):
    groups = WFD(draft_depth=4).call_groups(32)
    expected = alpha * 4 + (1 - alpha) * 32
    assert float(block_calls_per_token(groups, np.asarray(alpha))) == pytest.approx(expected)


def test_dtv_tends_to_d_calls_per_token_as_k_grows():
    calls = [float(block_calls_per_token(DtV(block_length=k, draft_depth=4).call_groups(32),
                                         np.asarray(1.0))) for k in (1, 4, 16, 64, 1024)]
    assert all(a > b for a, b in zip(calls, calls[1:], strict=False))
    assert calls[-1] == pytest.approx(4, rel=0.01)


@pytest.mark.parametrize("model", ["huginn-3.5b", "ouro-2.6b", "ouro-1.4b"])
@pytest.mark.parametrize("hw", ["a6000", "h100-sxm", "rtx4090"])
def test_at_zero_acceptance_nothing_beats_ar(model, hw):
    p = predict(model, hw, Workload(acceptance=0.0, context_length=512, new_tokens=128))
    assert p.schedules["dtv"].speedup_vs_ar <= 1.0
    assert p.schedules["wfd"].speedup_vs_ar <= 1.0


def test_dtv_best_k_falls_as_acceptance_falls():
    best = [predict("huginn-3.5b", "a6000", Workload(acceptance=a)).schedules["dtv"].block_length
            for a in (0.99, 0.95, 0.9, 0.8, 0.6, 0.3)]
    assert all(a >= b for a, b in zip(best, best[1:], strict=False))
    assert best[0] > best[-1]


def test_default_prediction_orders_the_schedules():
    p = predict("huginn-3.5b", "a6000", width=8)
    s = p.schedules
    assert s["wfd"].latency_per_token_s < s["dtv"].latency_per_token_s < s[
        "ar"].latency_per_token_s
    assert s["wfd"].draft_depth == 4 and s["wfd"].width == 8


def test_replaying_an_acceptance_sequence_is_deterministic():
    seq = [True, True, False, True] * 100
    a = simulate(HUGINN, A6000, WFD(draft_depth=4), context_length=10, new_tokens=300,
                 accept_sequence=seq)
    b = simulate(HUGINN, A6000, WFD(draft_depth=4), context_length=10, new_tokens=300,
                 accept_sequence=seq)
    assert a.latency_s == b.latency_s and a.rejected == b.rejected > 0
    assert a.accepted + a.rejected == a.committed_tokens


def test_simulated_calls_follow_the_trace_schema_and_reconcile():
    res = simulate(HUGINN, A6000, WFD(draft_depth=4), context_length=10, new_tokens=200,
                   acceptance=0.8, seed=3)
    position_steps = sum(len(r.positions) for r in res.records if r.kind == "block")
    # every committed position went through R steps; flushed ones through fewer
    assert position_steps >= 32 * res.committed_tokens
    for r in res.records:
        assert len(r.positions) == len(r.depths) == len(r.contexts) == len(r.slots)
        if r.kind == "block":
            assert len(set(r.depths)) == len(r.depths)  # one slot per in-flight depth
        assert r.wall_s > 0


def test_width_cap_delays_entry():
    free = simulate(HUGINN, A6000, WFD(draft_depth=4), context_length=8, new_tokens=101,
                    acceptance=1.0)
    capped = simulate(HUGINN, A6000, WFD(draft_depth=4, width_cap=4), context_length=8,
                      new_tokens=101, acceptance=1.0)
    assert max(len(r.positions) for r in capped.records if r.kind == "block") == 4
    assert capped.block_calls > free.block_calls
    assert capped.block_calls / capped.committed_tokens == pytest.approx(32 / 4, rel=0.1)


def test_ar_simulation_equals_closed_form_exactly_at_fixed_context():
    sim = simulate(HUGINN, A6000, AR(), context_length=1000, new_tokens=3)
    latency, calls = closed_form(HUGINN, A6000, AR(), 0.0, 1000, 3)
    assert calls == 32
    assert sim.latency_per_token_s == pytest.approx(latency, rel=1e-3)
    assert math.isclose(sim.block_calls / sim.committed_tokens, 32)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(schedules, st.floats(0.0, 1.0), st.sampled_from([0, 2]), st.integers(1, 4))
def test_simulating_without_records_prices_the_same(schedule, alpha, sharing, batch):
    """The record-free simulation (the recommender's) prices exactly what the records price."""
    args = dict(context_length=300, new_tokens=120, acceptance=alpha, kv_sharing=sharing,
                batch_size=batch, seed=1)
    full = simulate(HUGINN, A6000, schedule, **args)
    lean = simulate(HUGINN, A6000, schedule, records=False, **args)
    assert lean.records == [] and lean.block_calls == full.block_calls
    assert lean.latency_s == pytest.approx(full.latency_s, rel=1e-12)
    assert lean.breakdown_s == pytest.approx(full.breakdown_s, rel=1e-12)


def _cpu_and_model():
    """A CPU (a matrix-product curve with a 16 MiB cache) and a model each of whose parts fits
    that cache while the three together do not: a call after another part's streams its
    weights, a block call after a block call reads them from the cache."""
    from conftest import cpu_like_product_s, synthetic_curve

    hw = A6000.with_terms(**{"overhead_overlaps": False, "kernels_per_layer": 14,
                                  "launch_overhead_s": 5e-6,
                                  "peak_flops_per_s": {"bf16": 100e9},
                                  "matmul": synthetic_curve(cpu_like_product_s, "bf16")})
    model = get_model("huginn-tiny").model_copy(update={"hidden_size": 512, "mlp_size": 1408,
                                                        "num_heads": 8, "num_kv_heads": 8})
    sizes = [p.weight_params * 2 for p in model.parts.values()]
    assert max(sizes) < 2**24 < sum(sizes)
    return hw, model


def test_on_a_cpu_the_closed_form_knows_which_calls_follow_another_part():
    hw, model = _cpu_and_model()
    depth = model.default_depth
    sim = simulate(model, hw, AR(), context_length=100, new_tokens=3)
    latency, _ = closed_form(model, hw, AR(), 0.0, 100, 3)
    assert sim.latency_per_token_s == pytest.approx(latency, rel=1e-3)
    # every call priced as its part repeating would be faster: the flags matter, most in a
    # schedule whose parts take turns call by call
    pricer = _Pricer(model, hw, "bf16", np.asarray(100.5), np.asarray(1.0), None)
    for schedule, margin in ((AR(), 0.98), (WFD(draft_depth=2), 0.9)):
        groups = schedule.call_groups(depth)
        warm = [g.__class__(g.part, g.positions, g.slots, g.count, g.basis, False)
                for g in groups]
        assert (float(pricer.per_token(warm, np.asarray(0.9))["latency_s"])
                < margin * float(pricer.per_token(groups, np.asarray(0.9))["latency_s"]))
    for schedule in (WFD(draft_depth=1), WFD(draft_depth=2), DtV(block_length=3, draft_depth=2)):
        for alpha in (1.0, 0.7):
            sims = [simulate(model, hw, schedule, context_length=100, new_tokens=400,
                             acceptance=alpha, seed=s, records=records)
                    for s in range(3) for records in (True, False)]
            assert sims[0].latency_s == pytest.approx(sims[1].latency_s, rel=1e-12)
            mean = np.mean([s.latency_per_token_s for s in sims])
            latency, _ = closed_form(model, hw, schedule, alpha, 100, 400)
            assert mean == pytest.approx(latency, rel=0.05)


def test_graphs_mode_prices_the_static_spans_a_decode_reads():
    """In graphs mode a decode call reads whole blocks of keys (costmodel.slots.static_span):
    the closed form's mean over the run and the simulator's calls price the same keys."""
    from costmodel.slots import mean_decode_keys

    graphs, workload = A6000.in_mode("graphs"), Workload(context_length=1000, new_tokens=300)
    sim = simulate(HUGINN, graphs, AR(), context_length=1000, new_tokens=300)
    ar = predict(HUGINN, graphs, workload).schedules["ar"]
    assert sim.latency_per_token_s == pytest.approx(ar.latency_per_token_s, rel=2e-3)
    assert {r.contexts[0] for r in sim.records if r.kind == "block"} == {1024, 1280, 1536}
    eager = predict(HUGINN, A6000, workload).schedules["ar"]
    keys = mean_decode_keys(1000, 300, True) / mean_decode_keys(1000, 300, False)
    assert ar.breakdown.kv_s / eager.breakdown.kv_s == pytest.approx(keys, rel=0.01)


def test_a_draft_depth_is_refused_with_the_range_it_must_lie_in():
    from costmodel.predict import resolve_draft_depth

    spec = get_model("huginn-3.5b")
    assert resolve_draft_depth(spec, 32, 2, None) == 16
    for depth, width, draft, message in ((32, 1, None, r"width must be in 2\.\.32"),
                                         (32, None, 32, r"draft depth must be in 1\.\.31"),
                                         (1, None, None, "a depth R of at least 2"),
                                         (1, 2, None, "a depth R of at least 2"),
                                         (1, 0, None, "a depth R of at least 2")):
        with pytest.raises(ValueError, match=message):
            resolve_draft_depth(spec, depth, width, draft)
