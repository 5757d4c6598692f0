"""Batched decoding (wfd.batch): every sequence's tokens are its own batch-1 AR run's, the batch
stays in step and full, and its KV cache is the cost model's (`wfd generate --prompts-file`:
test_prompts_file.py)."""

import functools

import pytest
import torch
from conftest import model_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.presets import get_hardware, get_model
from costmodel.schedules import AR, WFD, DtV
from costmodel.simulate import acceptance_draws, call_shape, simulate, simulate_batch
from wfd import runtime
from wfd.batch import Request, decode_batch
from wfd.generate import GenerationError, Sampling, generate
from wfd.layers import slot_layout

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def ar_tokens(family: str, easy: bool, prompt: tuple[int, ...], new: int,
              stop: frozenset[int]) -> list[int]:
    model = model_for(family, easy)
    return generate(model, list(prompt), max_new_tokens=new, stop_tokens=stop,
                    record=False).tokens


batches = st.lists(st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=12),
                             st.integers(1, 12)), min_size=1, max_size=6)


@SETTINGS
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), st.sampled_from(["ar", "dtv", "wfd"]),
       batches, st.integers(1, 4), st.integers(1, 6), st.booleans(),
       st.sampled_from(["eager", "static"]))
def test_each_sequence_equals_its_own_ar_run(family, easy, schedule, prompts, batch_size, k,
                                             stop, mode):
    """Ragged prompts, different budgets and stop tokens (sequences end at different calls),
    more prompts than the batch holds (continuous batching): fp32 greedy tokens are exact."""
    model = model_for(family, easy)
    stops = frozenset({7, 21}) if stop else frozenset()
    requests = [Request(i, p, n) for i, (p, n) in enumerate(prompts)]
    run = decode_batch(model, requests, schedule=schedule, batch_size=batch_size,
                       block_length=k, stop_tokens=stops, mode=mode, record=True)
    got = {r.index: r.tokens for r in run.results}
    assert sorted(got) == list(range(len(prompts)))
    for i, (p, n) in enumerate(prompts):
        assert got[i] == ar_tokens(family, easy, tuple(p), n, stops), (i, schedule)
    assert {s for r in run.records for s in r.sequences} <= set(range(batch_size))


def test_sampling_and_forced_outcomes_are_the_batch_1_run():
    """Sampled tokens and forced outcomes depend on (seed, position) only: a batch gives each
    sequence the tokens of its batch-1 run (forced outcomes seeded by seed + its index), a
    request with a sampling seed of its own those of its run with that seed."""
    model = model_for("huginn", True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [1, 2, 3]]
    own = {3: 11}  # the first prompt again, sampled with a seed of its own
    sampling = Sampling(temperature=0.8, seed=3)
    run = decode_batch(model, [Request(i, p, 10, sampling_seed=own.get(i))
                               for i, p in enumerate(prompts)],
                       schedule="wfd", batch_size=2, sampling=sampling, force_acceptance=0.7,
                       seed=5)
    for r in run.results:
        alone = generate(model, prompts[r.index], schedule="wfd", max_new_tokens=10,
                         sampling=Sampling(0.8, seed=own.get(r.index, 3)),
                         force_acceptance=0.7, seed=5 + r.index, record=False)
        assert r.tokens == alone.tokens and r.acceptance == alone.stats["acceptance"]
        assert (r.drafts_verified, r.accepted) == (alone.stats["drafts_verified"],
                                                   alone.stats["accepted"])
        assert r.forced_acceptance
    tokens = {r.index: r.tokens for r in run.results}
    assert tokens[3] != tokens[0]  # the same prompt, another seed


@pytest.mark.parametrize("schedule", ["ar", "dtv", "wfd"])
def test_equal_sequences_decode_in_step(schedule):
    """Sequences of the same shape run every call together: the batch makes as many block calls
    as one of them alone, each over B times the positions."""
    model = model_for("ouro", False)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
    alone = decode_batch(model, [Request(0, prompts[0], 12)], schedule=schedule, batch_size=1,
                         force_acceptance=1.0)
    batch = decode_batch(model, [Request(i, p, 12) for i, p in enumerate(prompts)],
                         schedule=schedule, batch_size=3, force_acceptance=1.0)
    assert batch.stats["block_calls"] == alone.stats["block_calls"]
    assert batch.stats["positions_per_block_call"] == pytest.approx(
        3 * alone.stats["positions_per_block_call"])


def test_continuous_batching_keeps_the_batch_full():
    """A finished sequence's region goes to the next prompt at once: one long prompt and many
    short ones in a batch of two; while short ones remain, the long one decodes alone only
    while a newcomer waits for the next round (at most one round, R block calls, per
    admission)."""
    model = model_for("huginn", False)
    depth = model.config.depth
    shorts = 8
    requests = [Request(0, [1, 2], 30)] + [Request(i, [i, i + 1], 3)
                                           for i in range(1, shorts + 1)]
    finished = []
    run = decode_batch(model, requests, schedule="ar", batch_size=2, record=True,
                       on_result=lambda r: finished.append(r.index))
    assert finished[-1] == 0 and sorted(finished) == list(range(shorts + 1))
    assert {s for r in run.records for s in r.sequences} == {0, 1}  # two regions, reused
    last_short = max(i for i, r in enumerate(run.records) if 1 in r.sequences)
    alone = [r for r in run.records[:last_short]
             if r.kind == "block" and set(r.sequences) == {0} and min(r.positions) >= 2]
    assert len(alone) <= shorts * depth
    separate = sum(depth * (1 + r.max_new_tokens - 1) for r in requests)
    assert run.stats["block_calls"] < 0.7 * separate


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("schedule", ["ar", "dtv", "wfd"])
def test_kv_cache_is_what_the_cost_model_predicts(family, schedule):
    from costmodel import Workload, predict

    model = model_for(family, False)
    context, new, batch = 6, 9, 3
    run = decode_batch(model, [Request(i, [i + 1] * context, new) for i in range(batch)],
                       schedule=schedule, batch_size=batch, block_length=3,
                       force_acceptance=0.5)
    wl = Workload(context_length=context, new_tokens=new, batch_size=batch, dtype="fp32")
    predicted = predict(model.config, "h100-sxm", wl, block_length=3).schedules[schedule]
    assert run.stats["kv_bytes_allocated"] == predicted.kv_bytes


def test_a_batch_that_does_not_fit_is_refused_up_front(monkeypatch):
    model = model_for("ouro", False)
    one = decode_batch(model, [Request(0, [1, 2, 3], 8)], schedule="ar",
                       batch_size=1).stats["kv_bytes_allocated"]
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2 * one + one // 2)
    with pytest.raises(GenerationError, match=r"4 sequences of \d+ positions needs .* GB.*"
                                              r"at most 2 such sequences fit"):
        decode_batch(model, [Request(i, [1, 2, 3], 8) for i in range(6)], schedule="ar",
                     batch_size=4)
    # not even one sequence: how many of its positions would
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: one // 2)
    with pytest.raises(GenerationError, match=r"one sequence fits at most \d+ positions"):
        decode_batch(model, [Request(0, [1, 2, 3], 8)], schedule="ar", batch_size=1)


def test_bad_requests_are_refused():
    model = model_for("ouro", False)
    with pytest.raises(GenerationError, match="batch size"):
        decode_batch(model, [Request(0, [1], 2)], schedule="ar", batch_size=0)
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        decode_batch(model, [Request(0, [1], 2), Request(1, [], 2)], schedule="ar",
                     batch_size=2)
    with pytest.raises(GenerationError, match="ar, dtv or wfd"):
        decode_batch(model, [Request(0, [1], 2)], schedule="auto", batch_size=1)
    with pytest.raises(GenerationError, match="one time per request, in order"):
        decode_batch(model, [Request(0, [1], 2), Request(1, [2], 2)], schedule="ar",
                     batch_size=2, arrivals=[0.5, 0.1])


@pytest.mark.parametrize("schedule", ["ar", "wfd"])
def test_a_stream_s_requests_start_no_sooner_than_they_arrive(schedule):
    """``arrivals``: a request is admitted once its time has passed (an idle batch sleeps until
    then), in order, and its tokens are those of the same requests all at once."""
    model = model_for("huginn", False)
    requests = [Request(i, [i + 1, i + 2, i + 3], 4) for i in range(4)]
    arrivals = [0.0, 0.0, 0.15, 0.3]
    run = decode_batch(model, requests, schedule=schedule, batch_size=2, arrivals=arrivals)
    together = decode_batch(model, requests, schedule=schedule, batch_size=2)
    by_index = {r.index: r for r in run.results}
    for i, at in enumerate(arrivals):
        assert by_index[i].admitted_s >= at
    assert by_index[3].admitted_s < 0.3 + 0.25  # admitted at the round after it arrived
    assert {r.index: r.tokens for r in together.results} == {
        i: r.tokens for i, r in by_index.items()}


def test_slot_layouts_of_batched_calls():
    assert slot_layout((5, 37, 69)) == ("range", (5, 69, 32), False, 1)  # AR over 3 sequences
    assert slot_layout((7, 7, 39, 39, 71, 71)) == ("range", (7, 71, 32), False, 2)  # DtV verify
    # two WFD waves (each descending the depths of its sequence's region): a view each
    assert slot_layout((7, 5, 3, 38, 36)) == (
        "ranges", ((0, 3, 3, 2, True), (3, 2, 36, 2, True)), False, 1)
    assert slot_layout((3, 5, 7, 40)) == ("ranges", ((0, 3, 3, 2, False), (3, 1, 40, 1, False)),
                                          False, 1)
    assert slot_layout((1, 9, 4, 30, 2)) == ("gather", None, False, 1)  # no progression to read
    # prompts of unequal lengths prefilled together: a kernel per prompt on a CPU
    assert slot_layout((7, 7, 8)) == ("runs", ((0, 2, 7), (2, 1, 8)), False, 1)
    assert slot_layout((7, 7, 8), progressions=False) == ("gather", None, False, 1)


def test_runs_of_unequal_lengths_attend_as_a_gather_does():
    """Two sequences' positions of unequal counts in one call (a prefill of prompts of 3 and 5
    tokens): a kernel per run over its own slot gives the gathered attention's outputs (to
    rounding: the kernel's batch differs), and its keys stop at each run's own latest
    position."""
    from wfd.cache import LayerKV
    from wfd.layers import CallPlan, attend, rope_frequencies

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    slots = (4, 4, 4, 9, 9, 9, 9, 9)
    q = torch.randn(8, 4, 16, generator=gen)
    k, v = (torch.randn(8, 2, 16, generator=gen) for _ in "kv")  # grouped: 4 heads over 2
    outs = {}
    for progressions in (True, False):
        kv = LayerKV(torch.zeros(12, 2, 8, 16), torch.zeros(12, 2, 8, 16), [0] * 12)
        plan = CallPlan.make(positions, slots, torch.tensor(slots),
                             rope_frequencies(16, 10000.0, torch.device("cpu")), span=8)
        if not progressions:
            plan.layout, plan.slot_range, plan.progression_spans = "gather", None, None
        else:
            assert plan.layout == "runs" and plan.progression_spans == (3, 5)
        outs[progressions] = attend(q, k, v, plan, kv)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-6, atol=1e-6)  # to rounding


def test_each_sequences_wave_reads_its_own_context():
    """A batch's waves read each sequence's keys up to its own latest position, not the longest
    sequence's (the rest are masked anyway)."""
    from wfd.layers import CallPlan, rope_frequencies

    positions = torch.tensor([40, 41, 42, 90, 91])  # two sequences' waves, 50 positions apart
    plan = CallPlan.make(positions, (7, 5, 3, 38, 36), torch.tensor([7, 5, 3, 38, 36]),
                         rope_frequencies(8, 10000.0, "cpu"), span=92)
    assert plan.layout == "ranges" and plan.progression_spans == (43, 92)


def test_batched_calls_are_priced_per_sequence_slot():
    """Sequences share kernels (distinct slots) but each reads its own KV (distinct (sequence,
    slot) pairs)."""
    assert call_shape([3, 3], [10, 12], [0, 1]) == (2, 1, 22, 22, 2)
    assert call_shape([3, 3], [10, 12]) == (2, 1, 22, 12, 1)


def test_one_sequence_batch_is_the_decoder():
    """decode_batch at B = 1 runs the same calls as generate (one region, flat slots = slots)."""
    model = model_for("huginn", True)
    alone = generate(model, [4, 5, 6], schedule="dtv", max_new_tokens=9, block_length=3)
    run = decode_batch(model, [Request(0, [4, 5, 6], 9)], schedule="dtv", batch_size=1,
                       block_length=3, record=True)
    assert [(r.kind, r.positions, r.depths) for r in run.records] == [
        (r.kind, r.positions, r.depths) for r in alone.records]
    assert torch.equal(torch.tensor(run.results[0].tokens), torch.tensor(alone.tokens))


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("schedule", ["ar", "dtv", "wfd"])
def test_the_simulator_merges_a_batch_as_the_decoder_does(family, schedule):
    """Same sequences, same forced outcomes: the simulated batch makes the decoder's calls, call
    for call (ragged prompts, budgets, continuous batching)."""
    model = model_for(family, True)
    d = model.config.default_draft_depth
    prompts, news = [[1, 2, 3], [4] * 7, [5, 6], [7] * 4, [8]], [9, 4, 12, 6, 7]
    jobs = list(enumerate(zip(prompts, news, strict=True)))
    run = decode_batch(model, [Request(i, p, n) for i, (p, n) in jobs],
                       schedule=schedule, batch_size=3, block_length=3, force_acceptance=0.6,
                       seed=4, record=True)
    kind = {"ar": AR(), "dtv": DtV(block_length=3, draft_depth=d),
            "wfd": WFD(draft_depth=d)}[schedule]
    sim = simulate_batch(model.config, get_hardware("h100-sxm"), kind,
                         [(len(p), n, acceptance_draws(0.6, n + 1, 4 + i))
                          for i, (p, n) in jobs],
                         batch_size=3, dtype="fp32")
    assert [(r.kind, r.positions, r.depths, r.sequences) for r in sim.calls] == [
        (r.kind, r.positions, r.depths, r.sequences) for r in run.records]
    assert sim.decode_tokens == run.tokens - len(prompts)
    assert sim.latency_s > 0 and sim.block_calls == sum(
        r.kind == "block" for r, p in zip(sim.calls, sim.prefill, strict=True) if not p)


def test_a_simulated_batch_of_one_is_the_simulation():
    """One sequence: the batch simulator prices the decode as ``simulate`` does."""
    spec, hw = model_for("huginn", False).config, get_hardware("h100-sxm")
    draws = acceptance_draws(0.8, 40, 1)
    kind = WFD(draft_depth=2)
    alone = simulate(spec, hw, kind, context_length=9, new_tokens=30, accept_sequence=draws,
                     dtype="fp32", prefill=True)
    batch = simulate_batch(spec, hw, kind, [(9, 30, draws)], batch_size=1, dtype="fp32")
    assert batch.latency_s == pytest.approx(alone.latency_s, rel=1e-12)
    assert batch.decode_tokens == alone.committed_tokens


def test_a_simulated_batch_of_none_and_an_impossible_acceptance_are_refused():
    # batch size 0 looped for ever; an acceptance of 2 drew every draft accepted
    for batch_size, sequences in ((0, [(9, 30, None)]), (2, [])):
        with pytest.raises(ValueError, match="at least 1 at a time"):
            simulate_batch("huginn-3.5b", "h200", AR(), sequences, batch_size=batch_size)
    for alpha in (2.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="acceptance must be in"):
            simulate("huginn-3.5b", "h200", WFD(draft_depth=4), context_length=9,
                     new_tokens=30, acceptance=alpha)


def test_predicting_a_run_of_prompts_simulates_it_to_its_end():
    """``predict`` with ``Workload.prompts``: the run's figures, the batch simulator's on the
    draws a forced-acceptance decode makes; the steady state is what long runs tend to."""
    from costmodel import Workload, predict

    spec, hw = get_model("huginn-3.5b"), get_hardware("h100-sxm")

    def run(batch: int, prompts: int | None, new_tokens: int = 48):
        return predict(spec, hw, Workload(context_length=64, new_tokens=new_tokens,
                                          batch_size=batch, acceptance=0.8, prompts=prompts),
                       block_length=4).schedules

    steady, finite = run(4, None), run(4, 4)
    wfd = WFD(draft_depth=finite["wfd"].draft_depth)
    sim = simulate_batch(spec, hw, wfd, [(64, 48, acceptance_draws(0.8, 49, i))
                                         for i in range(4)], batch_size=4)
    assert finite["wfd"].tokens_per_s == pytest.approx(sim.tokens_per_s, rel=1e-12)
    assert finite["wfd"].block_calls_per_token == pytest.approx(sim.block_calls * 4 / 188)
    # the batch empties at the end, and waits for its unluckiest sequences
    for kind in ("dtv", "wfd"):
        assert finite[kind].tokens_per_s < steady[kind].tokens_per_s
    assert finite["ar"].tokens_per_s == pytest.approx(steady["ar"].tokens_per_s, rel=0.02)
    # many prompts through the same batch: nearer the steady state
    longer = run(4, 48)
    for kind in ("dtv", "wfd"):
        assert (abs(longer[kind].speedup_vs_ar / steady[kind].speedup_vs_ar - 1)
                < abs(finite[kind].speedup_vs_ar / steady[kind].speedup_vs_ar - 1))
        assert longer[kind].speedup_vs_ar == pytest.approx(steady[kind].speedup_vs_ar, rel=0.1)
        b = finite[kind].breakdown
        assert (b.weights_s + b.kv_s + b.compute_s + b.overhead_s) == pytest.approx(
            finite[kind].latency_per_token_s)
        assert 0 < finite[kind].roofline_fraction <= 1


def test_a_prompt_that_is_not_token_ids_of_the_vocabulary_is_one_clear_error():
    """From Python as from the command line: text, an id past the vocabulary, an empty prompt."""
    from conftest import tiny_model

    model = tiny_model("ouro")
    vocab = model.config.vocab_size
    for prompt, message in (("def f", "must be token ids"), ([1, vocab], f"token id {vocab}"),
                            ([], "is empty"), ([1, True], "must be token ids")):
        with pytest.raises(GenerationError, match=message):
            generate(model, prompt, max_new_tokens=2)
        with pytest.raises(GenerationError, match=f"prompt 0 {message}" if "token id" not in
                           message else message):
            decode_batch(model, [Request(index=0, prompt=prompt, max_new_tokens=2)],
                         schedule="ar", batch_size=1)
    import numpy as np

    ids = [int(i) for i in np.arange(1, 4)]
    as_numpy = list(np.arange(1, 4))  # a tokenizer's numpy integers are token ids too
    assert generate(model, as_numpy, max_new_tokens=2).tokens == generate(
        model, ids, max_new_tokens=2).tokens


def test_a_nan_temperature_and_depth_0_are_refused_not_decoded():
    # a NaN temperature sampled one token for ever; depth 0 ran at the model's default depth
    from conftest import tiny_model

    model = tiny_model("ouro")
    with pytest.raises(GenerationError, match="temperature"):
        Sampling(float("nan"))
    with pytest.raises(GenerationError, match="depth: .* 1, got 0"):
        generate(model, [1, 2], max_new_tokens=2, depth=0)
