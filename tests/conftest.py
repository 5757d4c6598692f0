import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from wfd.checkpoint import build, init_random
from wfd.config import ModelConfig

# The suite runs two workers on two cores: one thread each, in the processes they start too (a
# process with a thread per core spins against the other worker's; vLLM's engines take the
# same through VLLM_CPU_OMP_THREADS_BIND=nobind in tests/test_serving.py)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts a few hundred CLI processes. Where the environment turns bytecode caching
# off (PYTHONDONTWRITEBYTECODE, as on this project's VMs) each compiled the project's modules
# again, about 0.15 s a costmodel process: they keep their bytecode beside the sources instead
# (__pycache__, ignored by git), as Python does by default
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False



@pytest.fixture(autouse=True)
def _one_thread():
    """Back to one thread after a test that ran a script's main in process (it sets its own)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The slow tests first: pytest-xdist hands tests out in order, so the two workers share the
    long ones and the short ones fill in behind them, instead of a long one running alone at the
    end while the other worker idles; and a worker that runs out takes the other's pending ones
    (``--dist worksteal``, pyproject.toml: 343 s for the suite where handing out in fixed
    shares took 365-367)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
        _MODELS[key] = damped(model) if easy else model
    return _MODELS[key]


def damped(model):
    """``model`` with its core's residual branches scaled by 0.05: a well-conditioned
    recurrence, where fp32 rounding flips no token and shallow drafts are often right."""
    family = model.config.family
    with torch.no_grad():
        layers = model.transformer.core_block if family == "huginn" else model.model.layers
        for layer in layers:
            proj = layer.attn.proj if family == "huginn" else layer.self_attn.o_proj
            down = layer.mlp.proj if family == "huginn" else layer.mlp.down_proj
            proj.weight.mul_(0.05)
            down.weight.mul_(0.05)
    return model


@pytest.fixture(params=["huginn", "ouro"])
def family(request):
    return request.param


def synthetic_curve(seconds, dtype: str = "fp32"):
    """A matrix-product curve tabulated from ``seconds(matrix_bytes, rows, working_set_bytes)``
    on a grid like the calibration's (every size in the streamed set; in a smaller set, the
    sizes it holds)."""
    from costmodel.hardware import MatmulCurve

    rows = [1, 2, 3, 4, 8, 16, 32]
    sizes = [float(2**k) for k in range(14, 27, 2)]
    sets = [float(2**20), float(2**24), float(2**27)]
    table = [[[seconds(size, n, ws) for n in rows] if size <= ws or ws == sets[-1]
              else [None] * len(rows) for size in sizes] for ws in sets]
    return MatmulCurve(dtype=dtype, rows=rows, matrix_bytes=sizes, working_sets_bytes=sets,
                       seconds=table)


def cpu_like_product_s(size: float, rows: int, working_set: float) -> float:
    """A CPU-like product: 2 us to dispatch, one vector product per row below 4 rows and two
    passes of blocked kernels from there, weights at 20 GB/s from memory or 200 GB/s from a
    16 MiB cache, and 100 GFLOP/s of compute."""
    bandwidth = 200e9 if working_set <= 2**24 else 20e9
    passes = rows if rows < 4 else 2
    return 2e-6 + size / bandwidth * passes + 2 * (size / 4) * rows / 100e9


def bench_module(name: str):
    """A script of bench/ as a module (the benches import each other's helpers by name, so
    their folder goes on the path)."""
    folder = str(Path(__file__).resolve().parents[1] / "bench")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def run_cli(capsys, *args: str, program: str = "costmodel") -> tuple[int, str, str]:
    """A command line run in this process (no interpreter or torch to start): its exit code,
    standard output and error. ``program``: costmodel or wfd."""
    import importlib
    import sys

    main = importlib.import_module(f"{program}.cli").main
    argv, sys.argv = sys.argv, [program, *args]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return done.value.code, out.out, out.err
