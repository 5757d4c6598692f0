"""Adaptive depth: exit rules, DtV and WFD exact against AR with the same rule, compute saved
for real, the KV of skipped depths, depth traces that give exit depths, and the pricing."""

import numpy as np
import pytest
from conftest import model_for, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel import AR, WFD, DtV, Workload, get_hardware, predict, simulate
from costmodel.adaptive import ExitProfile
from costmodel.exits import EXIT_KV, ExitRule, parse_exit_depths
from costmodel.groups import block_calls_per_token
from costmodel.plans import EarlyExit
from costmodel.predict import _Pricer
from wfd.generate import GenerationError, generate

HARDWARE = get_hardware("a6000")
# thresholds at which the tiny random models exit at a spread of depths (easy: damped cores)
RULES = {"huginn": ["kl:0.05", "kl:0.5", "entropy-diff:0.05", "latent-diff:0.3",
                    "latent-diff:0.05", "argmax-stable:1", "argmax-stable:2"],
         "ouro": ["gate:0.3", "gate:0.6", "kl:0.05", "latent-diff:0.3", "argmax-stable:1"]}


def run(model, prompt, schedule="ar", **options):
    return generate(model, prompt, schedule=schedule, record=False, **options)


@st.composite
def exit_cases(draw):
    family = draw(st.sampled_from(["huginn", "ouro"]))
    # Huginn's coda attends: under the public code's KV rule a wave defers readouts
    kv = draw(st.sampled_from(EXIT_KV)) if family == "huginn" else "latest"
    rule = ExitRule.parse(draw(st.sampled_from(RULES[family])),
                          draw(st.integers(1, 3)), kv)
    return family, rule


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(exit_cases(), st.booleans(), st.lists(st.integers(0, 63), min_size=1, max_size=8),
       st.sampled_from(["dtv", "wfd"]), st.integers(1, 7), st.integers(1, 6),
       st.one_of(st.none(), st.integers(1, 6)), st.sampled_from([0, "R"]),
       st.sampled_from(["eager", "static"]))
def test_dtv_and_wfd_with_exits_equal_ar_with_the_same_rule(case, easy, prompt, schedule, d, k,
                                                            cap, sharing, mode):
    family, rule = case
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    # s >= R: a slot per depth, as without sharing (the reference KV rule keeps no sharing)
    sharing = depth if sharing == "R" and rule.kv == "latest" else 0
    ar = run(model, prompt, max_new_tokens=14, exit_rule=rule, kv_sharing=sharing)
    fast = run(model, prompt, schedule, max_new_tokens=14, exit_rule=rule, draft_depth=d,
               block_length=k, width_cap=cap, kv_sharing=sharing, mode=mode)
    assert fast.tokens == ar.tokens
    assert fast.stats["mean_exit_depth"] == ar.stats["mean_exit_depth"]


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_exits_happen_at_many_depths_and_save_block_calls(family):
    """The rules the property test draws do exit, at a spread of depths, and an exited token
    takes fewer block calls: AR's block calls are the prompt's R plus each token's exit depth."""
    model = model_for(family, True)
    depth = model.config.depth
    prompt = [5, 9, 33, 2, 17]
    seen: set[float] = set()
    for text in RULES[family]:
        res = generate(model, prompt, max_new_tokens=24, exit_rule=ExitRule.parse(text))
        decoded = [r for r in res.records if r.kind == "block" and min(r.positions) >= 5]
        assert len(decoded) == sum(_exit_depths_of(res))
        seen.add(res.stats["mean_exit_depth"])
    assert min(seen) < depth - 1 and len(seen) >= 3


def _exit_depths_of(result):
    """Each committed decoded token's depth, from the call trace (AR: one entry per position)."""
    prompt = len(result.prompt)
    depth_of: dict[int, int] = {}
    for r in result.records:
        if r.kind == "block":
            for p, dep in zip(r.positions, r.depths, strict=True):
                if p >= prompt:
                    depth_of[p] = max(depth_of.get(p, 0), dep)
    return [depth_of[p] for p in sorted(depth_of)][:len(result.tokens) - 1]


def test_a_wave_narrows_as_positions_exit():
    """WFD with exits takes fewer position-steps than without: exited positions leave the
    calls, and the wave is never wider than without exits."""
    model = model_for("huginn", True)
    prompt = [5, 9, 33, 2, 17]
    fixed = generate(model, prompt, schedule="wfd", max_new_tokens=24, draft_depth=2)
    early = generate(model, prompt, schedule="wfd", max_new_tokens=24, draft_depth=2,
                     exit_rule=ExitRule.parse("latent-diff:0.3"))
    assert early.call_stats()["position_steps"] < fixed.call_stats()["position_steps"]
    widest = max(len(r.positions) for r in early.records
                 if r.kind == "block" and min(r.positions) >= 5)
    assert widest <= fixed.stats["width"]


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_a_depth_trace_gives_the_exit_depth_of_each_rule(family):
    """The first decoded position attends over the prompt only (full depth in every run), so
    the exit depth a depth trace gives it under a rule is the one a run with that rule takes."""
    model = model_for(family, True)
    prompt = [7, 3, 21, 40]
    traced = generate(model, prompt, max_new_tokens=3, depth_trace=True)
    first = next(r for r in traced.depth_records if r.position == len(prompt))
    for text in RULES[family]:
        for min_depth in (1, 2):
            rule = ExitRule.parse(text, min_depth)
            res = generate(model, prompt, max_new_tokens=2, exit_rule=rule)
            assert rule.exit_depth(first, model.config.depth) == _exit_depths_of(res)[0]


def test_sampling_with_exits_matches_ar_with_exits_in_distribution():
    from test_speculative import same_distribution_pvalue, sampled_tokens

    model = tiny_model("ouro", seed=1)
    rule = ExitRule.parse("gate:0.5")
    ar = sampled_tokens("ar", 0, model, exit_rule=rule)
    for schedule in ("dtv", "wfd"):
        assert same_distribution_pvalue(ar, sampled_tokens(
            schedule, 10_000, model, exit_rule=rule, draft_depth=1, block_length=3)) > 0.001


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown exit rule"), ("kl:-1", "positive finite"), ("kl:inf", "positive finite"),
    ("kl:x", "not a number"), ("gate:1.5", "probability"), ("argmax-stable:2.5", "whole"),
])
def test_bad_rules_are_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        ExitRule.parse(text)


def test_a_rule_the_model_cannot_use_is_refused():
    with pytest.raises(GenerationError, match="exit gate"):
        generate(model_for("huginn", False), [1, 2], max_new_tokens=2,
                 exit_rule=ExitRule.parse("gate"))
    with pytest.raises(GenerationError, match="minimum exit depth"):
        generate(model_for("ouro", False), [1, 2], max_new_tokens=2,
                 exit_rule=ExitRule.parse("gate", min_depth=5))


# --- the plans and the pricing -----------------------------------------------------------


def _decoder_exits(result):
    """The exit depth of each entry of each decoded position, from the call trace: what the
    simulator replays (a flushed position re-enters and may exit elsewhere)."""
    entries: dict[int, list[int]] = {}
    for r in result.records:
        for p, dep in zip(r.positions, r.depths, strict=True):
            if p < len(result.prompt):
                continue
            if r.kind == "prelude":
                entries.setdefault(p, []).append(0)
            elif r.kind == "block":
                entries[p][-1] = max(entries[p][-1], dep)
    return lambda p, entry: entries[p][entry]


def shape(records):
    return [(r.kind, r.positions, r.depths, r.contexts, r.slots) for r in records]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(exit_cases(), st.booleans(), st.sampled_from(["ar", "dtv", "wfd"]),
       st.lists(st.integers(0, 63), min_size=1, max_size=6), st.integers(2, 14),
       st.integers(1, 5), st.integers(1, 7), st.one_of(st.none(), st.integers(1, 5)))
def test_a_run_with_exits_replays_call_for_call(case, easy, name, prompt, new_tokens, k, d, cap):
    family, rule = case
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    res = generate(model, prompt, schedule=name, max_new_tokens=new_tokens, draft_depth=d,
                   block_length=k, width_cap=cap, exit_rule=rule)
    schedule = {"ar": AR(), "dtv": DtV(block_length=k, draft_depth=d),
                "wfd": WFD(draft_depth=d, width_cap=cap)}[name]
    sim = simulate(model.config.to_spec("tiny"), HARDWARE, schedule,
                   context_length=len(prompt), new_tokens=new_tokens,
                   accept_sequence=res.acceptance_sequence(), depth=depth, prefill=True,
                   exits=rule.for_plan(model.config.coda_layers > 0, depth),
                   exit_depths=_decoder_exits(res))
    assert shape(sim.records) == shape(res.records)
    assert sim.committed_tokens == len(res.tokens) - 1


def closed_form(model, profile, groups, alpha):
    pricer = _Pricer(model, HARDWARE, "bf16", np.asarray(2048.0), np.asarray(1.0), None)
    totals = pricer.per_token(groups, np.asarray(alpha))
    return float(totals["latency_s"]), float(block_calls_per_token(groups, np.asarray(alpha)))


@pytest.mark.slow
@settings(max_examples=5, deadline=None, derandomize=True)
@given(st.dictionaries(st.integers(1, 32), st.floats(0.05, 1.0), min_size=1, max_size=4),
       st.floats(0.0, 1.0), st.booleans(), st.integers(1, 8), st.integers(1, 31),
       st.integers(0, 2**16))
def test_simulator_with_exits_agrees_with_the_closed_forms(weights, alpha, every, k, d, seed):
    """AR and DtV with exits drawn i.i.d.: the closed forms' expected calls and latency are the
    simulator's mean (the same tolerance as at fixed depth)."""
    model = HARDWARE and __import__("costmodel").get_model("huginn-3.5b")
    total = sum(weights.values())
    profile = ExitProfile.from_distribution({r: w / total for r, w in weights.items()}, 32,
                                            alpha, every)
    for schedule, groups, accept in (
            (AR(), AR().exit_groups(profile), 1.0),
            (DtV(block_length=k, draft_depth=d),
             DtV(block_length=k, draft_depth=d).exit_groups(profile),
             profile.acceptance(d))):
        sims = []
        for i in range(3):
            depths, ok = profile.draws(864, seed + i)
            sims.append(simulate(model, HARDWARE, schedule, context_length=2048, new_tokens=800,
                                 accept_sequence=ok, exits=profile.exits, exit_depths=depths,
                                 records=False))
        latency, calls = closed_form(model, profile, groups, accept)
        assert np.mean([s.block_calls / s.committed_tokens for s in sims]) == pytest.approx(
            calls, rel=0.08, abs=0.05)
        assert np.mean([s.latency_per_token_s for s in sims]) == pytest.approx(latency,
                                                                               rel=0.08)


def test_exits_at_r_price_as_fixed_depth():
    """Every token exiting at R is fixed depth: the same calls, the same latency (WFD is
    simulated with exits, so it agrees to its sampling error)."""
    fixed = predict("huginn-3.5b", "a6000", Workload(acceptance=0.8))
    full = predict("huginn-3.5b", "a6000", Workload(acceptance=0.8, exit_depths={32: 1.0}))
    for kind in ("ar", "dtv"):
        assert full.schedules[kind].latency_per_token_s == pytest.approx(
            fixed.schedules[kind].latency_per_token_s, rel=1e-12)
    assert full.schedules["wfd"].latency_per_token_s == pytest.approx(
        fixed.schedules["wfd"].latency_per_token_s, rel=0.03)


def test_shallower_exits_are_faster_and_narrow_wfds_lead():
    """The open question's shape on a preset: a shallower mean exit depth speeds every
    schedule up, and shrinks WFD's speedup over AR-with-exit."""
    speedups, ar_latency = [], []
    for mean in (32, 24, 16, 8):
        p = predict("huginn-3.5b", "h200", Workload(acceptance=0.9, exit_depths={mean: 1.0}))
        speedups.append(p.schedules["wfd"].speedup_vs_ar)
        ar_latency.append(p.schedules["ar"].latency_per_token_s)
    assert ar_latency == sorted(ar_latency, reverse=True)
    assert speedups == sorted(speedups, reverse=True)


@pytest.mark.parametrize("text, message", [
    ("4:0.5,6", "DEPTH:PROBABILITY"), ("40:1", "outside"), ("4:0.5,6:0.4", "sum to"),
    ("4:-1,6:2", ">= 0"),
])
def test_bad_exit_distributions_are_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_exit_depths(text, 32)


def test_a_workload_s_exit_distribution_is_checked_as_the_command_line_s():
    # one check for both; a NaN probability reached numpy's sampler before
    for dist, message in (({4: float("nan"), 32: 0.5}, ">= 0"), ({40: 1.0}, "outside"),
                          ({4: 0.5}, "sum to")):
        with pytest.raises(ValueError, match=message):
            predict("huginn-3.5b", "a6000", Workload(exit_depths=dist))


def test_plan_exit_checks_read_out_every_depth_only_where_needed():
    """A rule on the states with a coda that has no attention reads out only the exit depth;
    a rule on the readouts reads out every depth from the minimum on."""
    from costmodel.plans import Call, Check

    def events(every):
        plan = AR().plan(2, 4, coda_attends=False, prefill=False,
                         exits=EarlyExit(2, every)).steps()
        out, reply = [], None
        while len(out) < 12:
            event = plan.send(reply)
            out.append(event)
            reply = {2} if isinstance(event, Check) and event.depths == (3,) else (
                set() if isinstance(event, Check) else None)
            if not isinstance(event, (Call, Check)):
                break
        return [e for e in out if isinstance(e, Call) and e.kind == "coda"]

    assert [c.depths for c in events(False)] == [(3,)]
    assert [c.depths for c in events(True)] == [(2,), (3,)]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(exit_cases(), st.sampled_from(["ar", "dtv", "wfd"]),
       st.lists(st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=8),
                          st.integers(1, 10)), min_size=2, max_size=5), st.integers(1, 3))
def test_in_a_batch_each_sequences_positions_exit_on_their_own(case, schedule, prompts,
                                                               batch_size):
    """A batch goes on while one sequence's positions exit: each sequence's tokens are its own
    AR-with-exit run's, its tokens stopping at the same depths, and the batch's block calls
    hold only positions still going."""
    from wfd.batch import Request, decode_batch

    family, rule = case
    model = model_for(family, True)
    requests = [Request(i, p, n) for i, (p, n) in enumerate(prompts)]
    run = decode_batch(model, requests, schedule=schedule, batch_size=batch_size,
                       exit_rule=rule, record=True)
    for result in run.results:
        p, n = prompts[result.index]
        alone = generate(model, p, max_new_tokens=n, exit_rule=rule, record=False)
        assert (result.tokens, result.exit_depths) == (alone.tokens, alone.stats["exit_depths"])


# --- adaptive drafting -------------------------------------------------------------------

DRAFT_RULES = {"huginn": ["kl:0.5", "argmax-stable:1", "latent-diff:0.3"],
               "ouro": ["gate:0.3", "kl:0.5", "argmax-stable:1"]}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(),
       st.lists(st.integers(0, 63), min_size=1, max_size=8), st.sampled_from(["dtv", "wfd"]),
       st.integers(1, 7), st.integers(1, 6), st.one_of(st.none(), st.integers(1, 6)),
       st.booleans(), st.integers(0, 2), st.sampled_from(["eager", "static"]))
def test_adaptive_drafts_keep_dtv_and_wfd_exact(family, easy, prompt, schedule, d, k, cap,
                                                with_exit, which, mode):
    """Drafting at the first depth a looser rule fires (bounded by d) changes the drafts only:
    the tokens are AR's (with the same exit rule, when one is given)."""
    model = model_for(family, easy)
    d = min(d, model.config.depth - 1)
    rule = ExitRule.parse(RULES[family][which]) if with_exit else None
    draft_rule = ExitRule.parse(DRAFT_RULES[family][which])
    ar = run(model, prompt, max_new_tokens=14, exit_rule=rule)
    fast = run(model, prompt, schedule, max_new_tokens=14, exit_rule=rule,
               draft_rule=draft_rule, draft_depth=d, block_length=k, width_cap=cap, mode=mode)
    assert fast.tokens == ar.tokens


def test_adaptive_drafts_draft_shallower():
    """A draft rule that fires early drafts below d: fewer position-steps before each draft."""
    model = model_for("huginn", True)
    prompt = [5, 9, 33, 2, 17]
    fixed = run(model, prompt, "wfd", max_new_tokens=24, draft_depth=4)
    early = run(model, prompt, "wfd", max_new_tokens=24, draft_depth=4,
                draft_rule=ExitRule.parse("argmax-stable:1"))
    assert early.tokens == fixed.tokens
    assert early.stats["ticks"] < fixed.stats["ticks"]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), st.sampled_from(["dtv", "wfd"]),
       st.lists(st.integers(0, 63), min_size=1, max_size=6), st.integers(2, 14),
       st.integers(1, 5), st.integers(1, 7), st.booleans(), st.integers(0, 2))
def test_a_run_with_adaptive_drafts_replays_call_for_call(family, easy, name, prompt,
                                                          new_tokens, k, d, with_exit, which):
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    rule = ExitRule.parse(RULES[family][which]) if with_exit else None
    draft_rule = ExitRule.parse(DRAFT_RULES[family][which])
    res = generate(model, prompt, schedule=name, max_new_tokens=new_tokens, draft_depth=d,
                   block_length=k, exit_rule=rule, draft_rule=draft_rule)
    schedule = DtV(block_length=k, draft_depth=d) if name == "dtv" else WFD(draft_depth=d)
    fired = res.draft_fired

    def draft_at(p, entry):
        return fired[p][entry] or depth  # never below d: the rule did not fire

    sim = simulate(model.config.to_spec("tiny"), HARDWARE, schedule,
                   context_length=len(prompt), new_tokens=new_tokens,
                   accept_sequence=res.acceptance_sequence(), depth=depth, prefill=True,
                   exits=rule.for_plan(model.config.coda_layers > 0, depth) if rule else None,
                   exit_depths=_decoder_exits(res) if rule else None,
                   drafts=EarlyExit(draft_rule.min_depth, draft_rule.reads_readouts),
                   draft_depths=draft_at)
    assert shape(sim.records) == shape(res.records)


# --- forced exits (timing on random weights) ---------------------------------------------


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("schedule", [AR(), DtV(block_length=3, draft_depth=2),
                                      WFD(draft_depth=1), WFD(draft_depth=2, width_cap=2)])
def test_forced_exits_are_the_simulators_draws(family, schedule):
    """A timing run with forced exits (and forced acceptance) makes the simulator's calls with
    the same draws: each position's exit depth depends on (seed, position) only."""
    from costmodel.exits import ForcedExits

    model = model_for(family, False)
    depth = model.config.depth
    forced = ForcedExits.parse("2:0.3,3:0.3,4:0.4", depth, seed=3)
    kind = schedule.kind
    res = generate(model, [1, 2, 3, 4], schedule=kind, max_new_tokens=30,
                   draft_depth=getattr(schedule, "draft_depth", None),
                   block_length=getattr(schedule, "block_length", 4),
                   width_cap=getattr(schedule, "width_cap", None),
                   force_acceptance=None if kind == "ar" else 0.7, seed=5, exit_rule=forced)
    assert res.stats["forced_exits"] and res.stats["mean_exit_depth"] < depth
    sim = simulate(model.config.to_spec("tiny"), HARDWARE, schedule, context_length=4,
                   new_tokens=30, acceptance=0.7, seed=5, depth=depth, prefill=True,
                   exits=forced.for_plan(model.config.coda_layers > 0, depth),
                   exit_depths=lambda p, entry: forced.depth_at(p))
    assert shape(sim.records) == shape(res.records)


def test_forced_exit_draws_follow_their_distribution():
    from costmodel.exits import ForcedExits

    forced = ForcedExits.parse("4:0.25,8:0.75", 8)
    draws = [forced.depth_at(p) for p in range(4000)]
    assert set(draws) == {4, 8}
    assert draws.count(4) / len(draws) == pytest.approx(0.25, abs=0.03)


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_held_out_bits_through_the_decoder_equal_the_uncached_evaluation(family):
    """Teacher forcing through the decoder at fixed depth gives the uncached forward's bits per
    byte (what a card's exit table is measured against)."""
    import torch

    from wfd.heldout import held_out_bits
    from wfd.train import evaluate

    model = model_for(family, True)
    data = bytes((7 * i + i * i) % 64 for i in range(40))
    decoded = held_out_bits(model, data, None, windows=1, length=32)["bits_per_byte"]
    uncached = evaluate(model, torch.tensor(list(data)), model.config.depth, length=32,
                        windows=1)["bits_per_byte"][-1]
    assert decoded == pytest.approx(uncached, rel=1e-4)
    early = held_out_bits(model, data, ExitRule.parse(RULES[family][0]), windows=1, length=32)
    assert early["mean_exit_depth"] < model.config.depth


def test_the_gate_rule_on_a_model_without_a_gate_is_refused_by_name():
    # it asked to record the depth trace again, as if the trace were old
    with pytest.raises(ValueError, match="huginn-3.5b has none"):
        predict("huginn-3.5b", "a6000", Workload(exit_rule="gate:0.5", exit_depths={32: 1.0}))
