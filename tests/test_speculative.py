"""DtV and WFD in the decoder: exactness against AR, the cache after flushes, lossless sampling,
and the accounting of the call trace."""

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wfd.generate import Sampling, generate, generate_ar
from wfd.speculative import Draft, Verifier, generate_dtv, generate_wfd

MODELS = {}


def model_for(family: str, easy: bool):
    """A tiny random model; ``easy`` damps the core so that shallow drafts are often right,
    which exercises long accepted runs as well as rejections."""
    key = (family, easy)
    if key not in MODELS:
        model = tiny_model(family)
        if easy:
            with torch.no_grad():
                layers = (model.transformer.core_block if family == "huginn"
                          else model.model.layers)
                for layer in layers:
                    proj = layer.attn.proj if family == "huginn" else layer.self_attn.o_proj
                    down = layer.mlp.proj if family == "huginn" else layer.mlp.down_proj
                    proj.weight.mul_(0.05)
                    down.weight.mul_(0.05)
        MODELS[key] = model
    return MODELS[key]


prompts = st.lists(st.integers(0, 63), min_size=1, max_size=10)
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), prompts, st.integers(1, 8),
       st.integers(1, 7))
def test_dtv_greedy_equals_ar(family, easy, prompt, k, d):
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    ar = generate_ar(model, prompt, max_new_tokens=14, record=False)
    dtv = generate_dtv(model, prompt, max_new_tokens=14, block_length=k, draft_depth=d,
                       record=False)
    assert dtv.tokens == ar.tokens


@SETTINGS
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), prompts, st.integers(1, 7),
       st.one_of(st.none(), st.integers(1, 8)))
def test_wfd_greedy_equals_ar(family, easy, prompt, d, cap):
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    ar = generate_ar(model, prompt, max_new_tokens=14, record=False)
    wfd = generate_wfd(model, prompt, max_new_tokens=14, draft_depth=d, width_cap=cap,
                       record=False)
    assert wfd.tokens == ar.tokens


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_every_draft_depth_and_block_length(family):
    model = model_for(family, True)
    depth = model.config.depth
    prompt = [5, 9, 33, 2, 17]
    ar = generate_ar(model, prompt, max_new_tokens=20, record=False).tokens
    for d in range(1, depth):
        for k in range(1, 9):
            assert generate_dtv(model, prompt, max_new_tokens=20, block_length=k,
                                draft_depth=d, record=False).tokens == ar
        assert generate_wfd(model, prompt, max_new_tokens=20, draft_depth=d,
                            record=False).tokens == ar


def test_huginn_random_initial_state_is_the_same_for_every_schedule():
    model = tiny_model("huginn", init_scale=1.0, seed=3)
    prompt = [1, 2, 3, 4]
    ar = generate_ar(model, prompt, max_new_tokens=16, record=False).tokens
    assert generate_wfd(model, prompt, max_new_tokens=16, draft_depth=2,
                        record=False).tokens == ar
    assert generate_dtv(model, prompt, max_new_tokens=16, block_length=3, draft_depth=2,
                        record=False).tokens == ar


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("easy", [False, True])
def test_after_every_flush_the_cache_holds_what_ar_holds(family, easy):
    model = model_for(family, easy)
    prompt = [7, 3, 44, 12, 9]
    depth = model.config.depth
    ar = generate_ar(model, prompt, max_new_tokens=24, record=False)
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

    wfd = generate_wfd(model, prompt, max_new_tokens=24, draft_depth=1, on_flush=check,
                       record=False)
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


def test_kv_sharing_runs_and_equals_ar_when_nothing_is_shared():
    model = model_for("huginn", True)
    prompt = [3, 1, 4, 1, 5]
    for sharing in (1, 2, 3):
        ar = generate_ar(model, prompt, max_new_tokens=16, kv_sharing=sharing, record=False)
        wfd = generate_wfd(model, prompt, max_new_tokens=16, draft_depth=2,
                           kv_sharing=sharing, record=False)
        dtv = generate_dtv(model, prompt, max_new_tokens=16, block_length=3, draft_depth=2,
                           kv_sharing=sharing, record=False)
        assert len(wfd.tokens) == len(dtv.tokens) == len(ar.tokens) == 16
    depth = model.config.depth
    ar = generate_ar(model, prompt, max_new_tokens=16, kv_sharing=depth, record=False)
    assert generate_wfd(model, prompt, max_new_tokens=16, draft_depth=2, kv_sharing=depth,
                        record=False).tokens == ar.tokens


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
        _, token = verifier.verify(logits_p, Draft(draft.token, draft.probs), position=7)
        counts[token] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_wfd_sampling_matches_ar_in_distribution():
    from scipy.stats import chi2_contingency

    model = tiny_model("ouro", seed=1)
    prompt = [10, 20, 30]
    sampling = dict(temperature=1.0, top_p=0.95)
    ar_tokens, wfd_tokens = [], []
    for seed in range(300):
        ar = generate_ar(model, prompt, max_new_tokens=3, record=False,
                         sampling=Sampling(seed=seed, **sampling))
        wfd = generate_wfd(model, prompt, max_new_tokens=3, draft_depth=1, record=False,
                           sampling=Sampling(seed=10_000 + seed, **sampling))
        ar_tokens.append(ar.tokens[1:])
        wfd_tokens.append(wfd.tokens[1:])
    for i in range(2):
        a = torch.tensor([t[i] for t in ar_tokens])
        w = torch.tensor([t[i] for t in wfd_tokens])
        support = sorted(set(a.tolist()) | set(w.tolist()))
        table = [[int((a == s).sum()) for s in support], [int((w == s).sum()) for s in support]]
        frequent = [j for j in range(len(support)) if table[0][j] + table[1][j] >= 10]
        rest = [j for j in range(len(support)) if j not in frequent]
        rows = [[row[j] for j in frequent] + [sum(row[j] for j in rest)] for row in table]
        rows = [[x for x, keep in zip(r, [True] * len(frequent) + [bool(rest)], strict=True)
                 if keep] for r in rows]
        assert chi2_contingency(rows).pvalue > 0.001
