"""The static-shape path (the calls graphs mode captures, run on the CPU without capture): same
tokens and logits as eager, a bounded set of call shapes, and a cache of exactly the bytes the cost
model's memory model counts."""

import pytest
import torch
from conftest import model_for, tiny_model

from costmodel.predict import predict
from costmodel.workload import Workload
from wfd.generate import GenerationError, generate

PROMPT = [5, 9, 33, 2, 17, 40, 8]
SCHEDULES = {"ar": {}, "dtv": {"block_length": 3, "draft_depth": 1},
             "wfd": {"draft_depth": 1}}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_static_calls_match_eager(family, schedule):
    model = model_for(family, True)
    runs = {mode: generate(model, PROMPT, schedule=schedule, max_new_tokens=12, mode=mode,
                           **SCHEDULES[schedule]) for mode in ("eager", "static")}
    eager, static = runs["eager"], runs["static"]
    assert static.tokens == eager.tokens
    # the same calls, in the same order: only the attention span differs (masked keys)
    assert [(r.kind, r.positions, r.depths) for r in static.records] == \
        [(r.kind, r.positions, r.depths) for r in eager.records]
    for layer_s, layer_e in zip(static.cache.layers(), eager.cache.layers(), strict=True):
        assert layer_s.lengths == layer_e.lengths
        for slot, valid in enumerate(layer_e.lengths):  # past its length a slot holds stale keys
            torch.testing.assert_close(layer_s.keys[slot, :, :valid],
                                       layer_e.keys[slot, :, :valid], rtol=0, atol=1e-5)
    assert static.stats["mode"] == "static" and eager.stats["mode"] == "eager"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_call_shapes_do_not_grow_with_the_context(schedule):
    model = model_for("huginn", False)
    shapes = {}
    for n in (16, 48):
        result = generate(model, PROMPT, schedule=schedule, max_new_tokens=n, mode="static",
                          force_acceptance=0.7, **SCHEDULES[schedule])
        shapes[n] = result.stats["shapes_captured"]
        decode = [r for r in result.records if max(r.positions) >= len(PROMPT)]
        assert result.stats["replays"] == len(decode)
    assert shapes[16] == shapes[48]
    # AR: one decode step's (prelude, R block depths, coda); the prefill runs eagerly
    assert schedule != "ar" or shapes[16] == model.config.depth + 2


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sharing", [0, 2])
def test_kv_bytes_allocated_equal_the_memory_model(family, schedule, sharing):
    model = tiny_model(family)
    options = SCHEDULES[schedule]
    result = generate(model, PROMPT, schedule=schedule, max_new_tokens=20, kv_sharing=sharing,
                      force_acceptance=0.8, **options)
    workload = Workload(context_length=len(PROMPT), new_tokens=20, dtype="fp32",
                        kv_sharing=sharing, acceptance=0.8)
    prediction = predict(model.config, "a6000", workload,
                         draft_depth=options.get("draft_depth"),
                         block_length=options.get("block_length"))
    assert result.stats["kv_bytes_allocated"] == prediction.schedules[schedule].kv_bytes
    assert result.cache.used_bytes() <= result.stats["kv_bytes_allocated"]


def test_graphs_mode_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(GenerationError, match="needs a CUDA device"):
        generate(tiny_model("ouro"), PROMPT, max_new_tokens=2, mode="graphs")
    with pytest.raises(GenerationError, match="mode: .*got .fast."):
        generate(tiny_model("ouro"), PROMPT, max_new_tokens=2, mode="fast")
