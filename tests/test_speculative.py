"""DtV and WFD in the decoder: exactness against AR, the cache after flushes, lossless sampling,
and the accounting of the call trace."""

import pytest
import torch
from conftest import model_for, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wfd.generate import Sampling, generate
from wfd.sampling import Proposal, Verifier


def run(model, prompt, schedule="ar", **options):
    return generate(model, prompt, schedule=schedule, record=False, **options)


prompts = st.lists(st.integers(0, 63), min_size=1, max_size=10)
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


modes = st.sampled_from(["eager", "static"])  # static: the fixed-shape path graphs capture


@SETTINGS
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), prompts, st.integers(1, 8),
       st.integers(1, 7), modes)
def test_dtv_greedy_equals_ar(family, easy, prompt, k, d, mode):
    model = model_for(family, easy)
    d = min(d, model.config.depth - 1)
    ar = run(model, prompt, max_new_tokens=14)
    assert run(model, prompt, "dtv", max_new_tokens=14, block_length=k,
               draft_depth=d, mode=mode).tokens == ar.tokens


@SETTINGS
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), prompts, st.integers(1, 7),
       st.one_of(st.none(), st.integers(1, 8)), modes)
def test_wfd_greedy_equals_ar(family, easy, prompt, d, cap, mode):
    model = model_for(family, easy)
    d = min(d, model.config.depth - 1)
    ar = run(model, prompt, max_new_tokens=14)
    assert run(model, prompt, "wfd", max_new_tokens=14, draft_depth=d,
               width_cap=cap, mode=mode).tokens == ar.tokens


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_every_draft_depth_at_block_lengths_1_to_8(family):
    model = model_for(family, True)
    prompt = [5, 9, 33, 2, 17]
    ar = run(model, prompt, max_new_tokens=20).tokens
    for d in range(1, model.config.depth):
        for k in (1, 3, 8):  # and the hypothesis tests' draws between
            assert run(model, prompt, "dtv", max_new_tokens=20, block_length=k,
                       draft_depth=d).tokens == ar
        assert run(model, prompt, "wfd", max_new_tokens=20, draft_depth=d).tokens == ar


def test_huginn_random_initial_state_is_the_same_for_every_schedule():
    model = tiny_model("huginn", init_scale=1.0, seed=3)
    prompt = [1, 2, 3, 4]
    ar = run(model, prompt, max_new_tokens=16).tokens
    assert run(model, prompt, "wfd", max_new_tokens=16, draft_depth=2).tokens == ar
    assert run(model, prompt, "dtv", max_new_tokens=16, block_length=3,
               draft_depth=2).tokens == ar


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("easy", [False, True])
def test_after_every_flush_the_cache_holds_what_ar_holds(family, easy):
    model = model_for(family, easy)
    prompt = [7, 3, 44, 12, 9]
    depth = model.config.depth
    ar = run(model, prompt, max_new_tokens=24)
    flushes = []

    def check(cache, committed):
        valid = len(prompt) + len(committed) - 1  # the correction has not entered yet
        flushes.append(valid)
        pairs = list(zip(cache.prelude, ar.cache.prelude, strict=True)) + list(
            zip(cache.core, ar.cache.core, strict=True))
        for mine, theirs in pairs:
            assert all(n == valid for n in mine.lengths)
            torch.testing.assert_close(mine.keys[:, :, :valid], theirs.keys[:, :, :valid],
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(mine.values[:, :, :valid], theirs.values[:, :, :valid],
                                       rtol=0, atol=1e-5)
        for mine, theirs in zip(cache.coda, ar.cache.coda, strict=True):
            slot = cache.coda_slot(depth)
            torch.testing.assert_close(mine.keys[slot, :, :valid], theirs.keys[0, :, :valid],
                                       rtol=0, atol=1e-5)

    wfd = run(model, prompt, "wfd", max_new_tokens=24, draft_depth=1, on_rollback=check)
    assert wfd.tokens == ar.tokens
    assert flushes, "the run had no rejection to check"


@pytest.mark.parametrize("schedule", ["dtv", "wfd"])
def test_counts_reconcile(schedule):
    model = model_for("huginn", True)
    res = generate(model, [4, 8, 15, 16, 23, 42], schedule=schedule, max_new_tokens=30,
                   draft_depth=2, block_length=3)
    s, c = res.stats, res.call_stats()
    assert len(res.tokens) == 1 + s["accepted"] + s["corrections"] + s["bonus"]
    assert s["accepted"] > 0 and s["corrections"] > 0
    block = [r for r in res.records if r.kind == "block"]
    assert c["block_calls"] * c["positions_per_block_call"] == pytest.approx(
        sum(len(r.positions) for r in block))
    assert c["block_calls"] == res.block_calls
    if schedule == "wfd":
        # each block call advances every in-flight position, each at its own depth and slot
        ticks = block[8:]  # after the prefill's R = 8 calls
        assert all(len(set(r.depths)) == len(r.depths) for r in ticks)
        assert max(len(r.positions) for r in ticks) == 4  # W = ceil(8 / 2)
        assert s["ticks"] == len(block) - 8  # minus the prefill's R calls


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("sharing", [1, 2, 3])
def test_kv_sharing_below_r(family, sharing):
    """With s < R shared slots: depth r reads and writes slot (r - 1) mod s in every schedule;
    WFD with one position in flight runs AR's calls in AR's order, so it emits exactly the
    tokens of AR under the same sharing, whatever its drafts."""
    model = model_for(family, False)
    prompt = [3, 1, 4, 1, 5]
    ar = generate(model, prompt, max_new_tokens=16, kv_sharing=sharing)
    single = generate(model, prompt, schedule="wfd", max_new_tokens=16, draft_depth=1,
                      width_cap=1, kv_sharing=sharing)
    assert single.tokens == ar.tokens
    assert single.stats["corrections"] > 0  # drafts were rejected, and that changed nothing
    for res in (ar, single, generate(model, prompt, schedule="dtv", max_new_tokens=16,
                                     block_length=3, draft_depth=1, kv_sharing=sharing)):
        assert all(layer.keys.shape[0] == sharing for layer in res.cache.core)
        for record in (r for r in res.records if r.kind == "block"):
            assert record.slots == [(r - 1) % sharing for r in record.depths]


def test_kv_sharing_with_a_slot_per_depth_equals_no_sharing():
    model = model_for("huginn", True)
    prompt = [3, 1, 4, 1, 5]
    depth = model.config.depth
    ar = run(model, prompt, max_new_tokens=16)
    for schedule in ("ar", "dtv", "wfd"):
        assert run(model, prompt, schedule, max_new_tokens=16, draft_depth=2,
                   kv_sharing=depth).tokens == ar.tokens
    with pytest.raises(ValueError, match="at most R"):  # the cost model's rule: no slot beyond R
        run(model, prompt, max_new_tokens=4, kv_sharing=depth + 1)


def test_forced_acceptance_is_flagged_and_paces_the_wave():
    model = model_for("huginn", False)
    res = generate(model, [1, 2, 3], schedule="wfd", max_new_tokens=40, draft_depth=2,
                   force_acceptance=1.0)
    assert res.stats["forced_acceptance"] is True and res.stats["acceptance"] == 1.0
    # at full acceptance a token costs d ticks once the wave is full
    assert res.stats["ticks"] == pytest.approx(2 * 39 + (8 - 2), abs=1)


def test_speculative_sampling_verifier_is_exact():
    """Over many (seed, position) draws, draft-then-verify commits tokens distributed as p."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6) * 1.5, -1)
    q = torch.softmax(torch.randn(6) * 1.5, -1)
    logits_p, logits_q = p.log(), q.log()
    counts = torch.zeros(6)
    n = 20000
    for seed in range(n):
        verifier = Verifier(Sampling(temperature=1.0, seed=seed), None)
        draft = verifier.draft(logits_q, position=7)
        assert draft.probs is not None
        _, token = verifier.verify(logits_p, Proposal(draft.token, draft.probs), position=7)
        counts[token] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


SAMPLED_MODEL = ("ouro", 1)
SAMPLES = 300


def sampled_tokens(schedule: str, seed_offset: int, model=None, **options) -> list[list[int]]:
    """The tokens after the first of many sampled runs (T = 1, top-p 0.95), one seed each: one
    batch, whose sequences each decode as their own batch-1 run with that seed
    (tests/test_batch.py)."""
    from wfd.batch import Request, decode_batch

    model = model or tiny_model(SAMPLED_MODEL[0], seed=SAMPLED_MODEL[1])
    requests = [Request(i, [10, 20, 30], 4, sampling_seed=seed_offset + i)
                for i in range(SAMPLES)]
    done = decode_batch(model, requests, schedule=schedule, batch_size=SAMPLES,
                        sampling=Sampling(temperature=1.0, top_p=0.95), **options)
    return [r.tokens[1:] for r in sorted(done.results, key=lambda r: r.index)]


def same_distribution_pvalue(a: list[list[int]], b: list[list[int]]) -> float:
    """The smallest chi-square homogeneity p-value over the token positions (rare tokens pooled)."""
    from scipy.stats import chi2_contingency

    pvalues = []
    for i in range(len(a[0])):
        left, right = [t[i] for t in a], [t[i] for t in b]
        support = sorted(set(left) | set(right))
        table = [[row.count(s) for s in support] for row in (left, right)]
        frequent = [j for j in range(len(support)) if table[0][j] + table[1][j] >= 10]
        rest = [j for j in range(len(support)) if j not in frequent]
        rows = [[row[j] for j in frequent] + ([sum(row[j] for j in rest)] if rest else [])
                for row in table]
        pvalues.append(chi2_contingency(rows).pvalue)
    return min(pvalues)


@pytest.fixture(scope="module")
def ar_samples():
    return sampled_tokens("ar", 0)


@pytest.mark.parametrize("schedule", ["dtv", "wfd"])
def test_sampling_matches_ar_in_distribution(ar_samples, schedule):
    """DtV and WFD commit tokens distributed as AR's at every position; the same test tells a
    verifier that commits its drafts unchecked (the depth-d distribution) from AR's."""
    options = dict(draft_depth=1, block_length=3)
    assert same_distribution_pvalue(ar_samples, sampled_tokens(schedule, 10_000,
                                                               **options)) > 0.001
    if schedule == "dtv":  # the test has power: it rejects drafts committed unchecked
        unchecked = sampled_tokens(schedule, 10_000, force_acceptance=1.0, **options)
        assert same_distribution_pvalue(ar_samples, unchecked) < 0.001
