"""The looped models: checkpoints, incremental decoding against a full forward, KV sharing,
rollback, the depth trace, and parameter counts at real sizes."""

import json

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_model
from safetensors.torch import load_file, save_file

from costmodel import get_model
from wfd.cache import LayerKV
from wfd.checkpoint import CheckpointError, build, load_folder, load_model, save
from wfd.config import ModelConfig
from wfd.generate import full_forward, generate, make_cache, prefill
from wfd.runtime import Runner

PROMPT = [3, 17, 5, 60, 22, 9, 41, 8, 33, 2, 50, 12]


def decode_logits(model, tokens, depth, kv_sharing=0, readouts=None):
    """Prefill the first token, then feed the rest one by one; logits per depth per position."""
    readouts = readouts or list(range(1, depth + 1))
    cache = make_cache(model, prompt_len=1, max_new_tokens=len(tokens), depth=depth,
                       kv_sharing=kv_sharing, readout_depths=readouts)
    runner = Runner(model, cache, record=False)
    rows = {r: [v] for r, v in prefill(runner, tokens[:1], depth, readouts).items()}
    for p in range(1, len(tokens)):
        e, state = runner.prelude([tokens[p]], [p])
        for r in range(1, depth + 1):
            state = runner.block(state, e, [p], [r])
            if r in readouts:
                rows[r].append(runner.coda(state, [p], [r])[0])
    return {r: torch.stack(v) for r, v in rows.items()}, cache


def test_checkpoint_round_trip(family, tmp_path):
    model = tiny_model(family)
    save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] in ("huginn_raven",
                                                                               "ouro")
    back = load_folder(tmp_path)
    a = full_forward(model, PROMPT)[model.config.depth]
    b = full_forward(back, PROMPT)[model.config.depth]
    assert torch.equal(a, b)


def test_bf16_checkpoint_loads_into_fp32(tmp_path):
    model = tiny_model("ouro")
    save(model, tmp_path, dtype="bf16")
    back = load_folder(tmp_path, dtype=torch.float32)
    assert next(back.parameters()).dtype == torch.float32
    diff = (full_forward(model, PROMPT)[4] - full_forward(back, PROMPT)[4]).abs().max()
    assert 0 < diff < 0.5  # bf16 rounding of the weights, nothing worse


def test_sharded_checkpoint(tmp_path):
    model = tiny_model("huginn")
    save(model, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half],
              "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(tmp_path / name))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    back = load_folder(tmp_path)
    assert torch.equal(full_forward(model, PROMPT)[8], full_forward(back, PROMPT)[8])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update({"transformer.core_block.0.attn.Wqx.weight":
                         s.pop("transformer.core_block.0.attn.Wqkv.weight")}),
     "missing transformer.core_block.0.attn.Wqkv.weight; "
     "unexpected transformer.core_block.0.attn.Wqx.weight"),
    (lambda s: s.update({"transformer.adapter.weight": torch.zeros(3, 3)}),
     "transformer.adapter.weight"),
    (lambda s: s.update({"transformer.extra.weight": torch.zeros(3)}), "transformer.extra"),
    (lambda s: s.update({"transformer.adapter.weight": s["transformer.adapter.weight"].to(
        torch.int32)}), "transformer.adapter.weight holds torch.int32 values"),
])
def test_bad_tensors_are_named(tmp_path, edit, message):
    save(tiny_model("huginn"), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_folder(tmp_path)


def test_corrupt_or_foreign_folders(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="llama"):
        load_folder(tmp_path)
    save(tiny_model("ouro"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_folder(tmp_path)
    with pytest.raises(CheckpointError, match="huginn-3.5b:random"):
        load_model("no-such-model")
    save(tiny_model("huginn"), tmp_path / "huginn")
    config = json.loads((tmp_path / "huginn" / "config.json").read_text())
    (tmp_path / "huginn" / "config.json").write_text(json.dumps(
        {**config, "n_embd": 2 * config["n_embd"]}))
    with pytest.raises(CheckpointError, match="head_dim is hidden_size / num_heads") as bad:
        load_folder(tmp_path / "huginn")
    assert "\n" not in str(bad.value)  # the validator's message alone, in one line


@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_incremental_decoding_equals_full_forward_at_every_depth(family, init_scale):
    model = tiny_model(family, init_scale=init_scale)
    depth = model.config.depth
    full = full_forward(model, PROMPT, depth, list(range(1, depth + 1)))
    cached, _ = decode_logits(model, PROMPT, depth)
    for r in range(1, depth + 1):
        torch.testing.assert_close(cached[r], full[r], rtol=0, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 3, 11])
def test_any_depth_at_run_time(family, depth):
    model = tiny_model(family)
    full = full_forward(model, PROMPT, depth)
    cached, _ = decode_logits(model, PROMPT, depth, readouts=[depth])
    torch.testing.assert_close(cached[depth], full[depth], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharing", [1, 2, 3])
def test_kv_sharing(family, sharing):
    model = tiny_model(family)
    depth = model.config.depth
    # a prefill moves every position through each depth together: the shared slot holds
    # exactly the current depth's KV when it is read, as without sharing
    cache = make_cache(model, prompt_len=len(PROMPT), max_new_tokens=1, depth=depth,
                       kv_sharing=sharing, readout_depths=[depth])
    out = prefill(Runner(model, cache, record=False), PROMPT, depth, [depth])
    torch.testing.assert_close(out[depth], full_forward(model, PROMPT)[depth][-1], rtol=0,
                               atol=1e-5)
    # decoding one token at a time, a past position contributes its last write into the slot:
    # the KV of the deepest depth mapped to that slot (Huginn's compress-s semantics)
    writes = {}
    original = LayerKV.write

    def logging_write(self, slot_index, positions, k, v):
        for i, (slot, pos) in enumerate(zip(slot_index.tolist(), positions.tolist(),
                                            strict=True)):
            writes[(id(self), slot, pos)] = (k[i].clone(), v[i].clone())
        return original(self, slot_index, positions, k, v)

    LayerKV.write = logging_write
    try:
        _, shared = decode_logits(model, PROMPT, depth, kv_sharing=sharing, readouts=[depth])
    finally:
        LayerKV.write = original
    for layer in shared.core:
        assert layer.lengths == [len(PROMPT)] * sharing
        for slot in range(sharing):
            for pos in range(len(PROMPT)):
                k, v = writes[(id(layer), slot, pos)]
                assert torch.equal(layer.keys[slot, :, pos], k)
                assert torch.equal(layer.values[slot, :, pos], v)
    # with as many shared slots as depths, sharing changes nothing
    a, _ = decode_logits(model, PROMPT, depth, kv_sharing=depth, readouts=[depth])
    b, _ = decode_logits(model, PROMPT, depth, readouts=[depth])
    assert torch.equal(a[depth], b[depth])


def test_rollback_equals_never_decoding(family):
    model = tiny_model(family)
    depth = model.config.depth
    cache = make_cache(model, prompt_len=len(PROMPT), max_new_tokens=8, depth=depth,
                       kv_sharing=0, readout_depths=[depth])
    runner = Runner(model, cache, record=False)
    prefill(runner, PROMPT[:6], depth, [depth])

    def step(token, p):
        e, state = runner.prelude([token], [p])
        for r in range(1, depth + 1):
            state = runner.block(state, e, [p], [r])
        return runner.coda(state, [p], [depth])[0]

    for p in range(6, 9):  # decode three tokens that will be discarded
        step(60 - p, p)
    cache.truncate(6)
    after_rollback = [step(PROMPT[p], p) for p in range(6, len(PROMPT))]
    full = full_forward(model, PROMPT)[depth]
    torch.testing.assert_close(torch.stack(after_rollback), full[6:], rtol=0, atol=1e-5)


def test_a_schedule_that_forgets_to_roll_back_is_caught():
    model = tiny_model("ouro")
    cache = make_cache(model, prompt_len=4, max_new_tokens=4, depth=4, kv_sharing=0,
                       readout_depths=[4])
    runner = Runner(model, cache, record=False)
    prefill(runner, PROMPT[:4], 4, [4])
    e, state = runner.prelude([1], [2])
    with pytest.raises(RuntimeError, match="truncate first"):
        runner.block(state, e, [2], [1])
    e, state = runner.prelude([1], [6])
    with pytest.raises(RuntimeError, match="hole"):
        runner.block(state, e, [6], [1])


def test_depth_trace_final_depth_equals_the_ar_tokens(family):
    model = tiny_model(family)
    res = generate(model, PROMPT, max_new_tokens=12, depth_trace=True)
    assert [rec.predictions[-1] for rec in res.depth_records] == res.tokens
    assert [rec.position for rec in res.depth_records] == list(range(len(PROMPT) - 1,
                                                                    len(PROMPT) + 11))
    plain = generate(model, PROMPT, max_new_tokens=12)
    assert plain.tokens == res.tokens
    assert plain.block_calls == model.config.depth * 12


def test_ar_trace_counts():
    model = tiny_model("huginn")
    res = generate(model, PROMPT, max_new_tokens=5)
    kinds = [r.kind for r in res.records]
    assert kinds.count("prelude") == 5 and kinds.count("coda") == 5
    first_block = next(r for r in res.records if r.kind == "block")
    assert first_block.positions == list(range(len(PROMPT)))  # the prefill
    assert all(r.wall_s > 0 for r in res.records)


def test_sampling_is_seeded_by_position():
    from wfd.generate import Sampling

    model = tiny_model("ouro")
    a = generate(model, PROMPT, max_new_tokens=16, sampling=Sampling(1.0, 0.9, seed=4))
    b = generate(model, PROMPT, max_new_tokens=16, sampling=Sampling(1.0, 0.9, seed=4))
    c = generate(model, PROMPT, max_new_tokens=16, sampling=Sampling(1.0, 0.9, seed=5))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_tokens_end_generation():
    model = tiny_model("ouro")
    free = generate(model, PROMPT, max_new_tokens=10)
    stop = free.tokens[3]
    res = generate(model, PROMPT, max_new_tokens=10, stop_tokens=frozenset({stop}))
    assert res.tokens == free.tokens[:free.tokens.index(stop) + 1]


def test_huginn_initial_state_depends_only_on_seed_and_position():
    model = tiny_model("huginn")
    like = torch.zeros(1, 64)
    a = model.initial_state([3, 7], like)
    assert torch.equal(a[1], model.initial_state([7], like)[0])
    assert not torch.equal(a[0], a[1])
    assert a.abs().max() <= 3 * (2 / (5 * 64)) ** 0.5 * 8 + 1e-6  # truncated at 3 std, x sqrt(h)
    model.init_scale = 0.0
    assert torch.equal(model.initial_state([3], like), torch.zeros(1, 64))


@pytest.mark.parametrize("preset", ["huginn-3.5b", "ouro-2.6b", "ouro-1.4b"])
def test_parameter_counts_at_real_size(preset):
    model = build(ModelConfig.from_spec(get_model(preset)), device="meta")
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) == get_model(preset).num_params


def test_tiny_config_round_trips_through_hf_keys(family):
    cfg = TINY_CONFIGS[family]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_as_single_operations_compute_the_release_formulas(dtype):
    """RMSNorm dispatches one operation where the releases write six, and Huginn's RoPE one
    complex product where it writes seven; on a CPU both give exactly the releases' values."""
    from wfd.layers import CallPlan, RMSNorm, rope_interleaved

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, 64):
        x = (3 * torch.randn(rows, 96, generator=gen)).to(dtype)
        norm = RMSNorm(96, 1e-6).to(dtype)
        norm.weight.data = torch.randn(96, generator=gen).to(dtype)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(norm(x), norm.weight * normed.to(dtype))

        plan = CallPlan.uncached(list(range(100, 100 + rows)), TINY_CONFIGS["huginn"], "cpu")
        # q and k side by side, a slice of a wider projection (as the attention rotates them)
        qk = torch.randn(rows, 5 * 16 + 48, generator=gen).to(dtype)[:, :80].unflatten(-1, (5, 16))
        pairs = qk.float().unflatten(-1, (-1, 2))
        cos, sin = plan.cos[:, None, :], plan.sin[:, None, :]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        release = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)
        assert torch.equal(rope_interleaved(qk, plan.rotations()),
                           release.flatten(-2).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_calls_additive_mask_attends_as_the_boolean_mask_does(dtype):
    """The mask a call makes once, additive in the queries' dtype, gives bitwise the outputs of
    the boolean causal mask it stands for, for each way a call reads its slots."""
    import torch.nn.functional as F

    from wfd.layers import CallPlan, rope_frequencies, slot_layout

    gen = torch.Generator().manual_seed(0)
    frequencies = rope_frequencies(16, 10000.0, torch.device("cpu"))
    # one key set (AR), shared by groups of queries (DtV), a descending range (a wave), gathered
    for slots in ((0,) * 3, (0, 0, 2, 2), (3, 2, 1), (0, 2, 3)):
        n = len(slots)
        positions = torch.arange(20, 20 + n)
        plan = CallPlan.make(positions, slots, torch.tensor(slots), frequencies, span=24)
        _, _, descending, per_group = slot_layout(slots)
        q = torch.randn(n // per_group, 4, per_group, 16, generator=gen).to(dtype)
        k, v = (torch.randn(n // per_group, 4, 24, 16, generator=gen).to(dtype) for _ in "kv")
        boolean = plan.mask.unflatten(0, (-1, per_group))[:, None]
        if descending:
            boolean = boolean.flip(0)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=boolean),
                           F.scaled_dot_product_attention(q, k, v,
                                                          attn_mask=plan.attention_mask(dtype)))


def test_weights_that_do_not_fit_are_refused_before_they_are_made(monkeypatch):
    # a 3.5B random model was made whatever the memory (14 GB in fp32, then cast)
    import wfd.checkpoint
    from wfd.checkpoint import CheckpointError, load_model

    monkeypatch.setattr(wfd.checkpoint, "free_memory_bytes", lambda device: 2e9)
    for dtype in ("fp32", "bf16"):
        with pytest.raises(CheckpointError, match=r"need 14.3 GB to load \(made in fp32, then "
                                                  r"cast\) and the cpu has 2.0 GB free"):
            load_model("huginn-3.5b:random", dtype=dtype)
    assert load_model("huginn-tiny", dtype="bf16") is not None  # a small one loads
