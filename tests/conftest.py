import pytest
import torch

from wfd.checkpoint import build, init_random
from wfd.config import ModelConfig

torch.set_num_threads(1)  # the suite runs two workers on two cores

TINY_CONFIGS = {
    "huginn": ModelConfig(family="huginn", hidden_size=64, num_heads=4, num_kv_heads=4,
                          head_dim=16, mlp_size=96, vocab_size=64, prelude_layers=1,
                          core_layers=2, coda_layers=1, default_depth=8,
                          max_position_embeddings=256, rope_base=50000.0, qk_bias=True,
                          tied_head=True),
    "ouro": ModelConfig(family="ouro", hidden_size=64, num_heads=4, num_kv_heads=2,
                        head_dim=16, mlp_size=96, vocab_size=64, prelude_layers=0,
                        core_layers=2, coda_layers=0, default_depth=4, max_position_embeddings=256,
                        rope_base=1e6, exit_gate=True),
}


def tiny_model(family: str, *, init_scale: float = 1.0, seed: int = 0, depth: int | None = None):
    cfg = TINY_CONFIGS[family]
    if depth is not None:
        cfg = cfg.model_copy(update={"default_depth": depth})
    return init_random(build(cfg, init_scale=init_scale, seed=seed), seed=seed)


_MODELS = {}


def model_for(family: str, easy: bool):
    """A tiny random model, built once per test process; ``easy`` damps the core so that shallow
    drafts are often right, which exercises long accepted runs as well as rejections."""
    key = (family, easy)
    if key not in _MODELS:
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
        _MODELS[key] = model
    return _MODELS[key]


@pytest.fixture(params=["huginn", "ouro"])
def family(request):
    return request.param
