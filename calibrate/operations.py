"""What the decoder dispatches, counted by class per layer and per part (matrix products,
attention, other kernels, views), the host time of each class, and what a CUDA graph's replay
costs: the terms a calibration prices a call's operations by (the presets' table of them:
calibrate.tables)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from costmodel.hardware import HardwareSpec
from wfd.timing import _best_time, _timed_runner

# Operations that only make a new view of a tensor (or hand it back): the host dispatches them,
# no kernel runs. A GPU calibration prices them apart (HardwareSpec.operations.layer_operations).
METADATA_OPS = {"lift_fresh", "detach", "detach_", "alias", "to"}
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def operation_class(func, args: tuple, out) -> str:
    """matmul, attention, view (no kernel: a view, or an input handed back) or other."""
    name = func._schema.name.split("::")[-1]
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    handed_back = isinstance(out, torch.Tensor) and any(out is a for a in args)
    if name == "to":  # its schema may alias (so is_view), but a cast to another dtype copies
        return "view" if handed_back else "other"
    if func.is_view or name in METADATA_OPS:
        return "view"
    return "other"


def count_ops(model, kind: str) -> dict[str, int]:
    """Operations the decoder dispatches for one call of ``kind`` over one position, by class
    (``operation_class``): what the cost model counts as kernels, each paying the per-kernel
    overhead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = dict.fromkeys(HardwareSpec.OPERATION_CLASSES, 0)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counts[operation_class(func, args, out)] += 1
            return out

    runner = _timed_runner(model, 8, 1, record=False)  # eager: the operations one call issues
    param = next(model.parameters())
    state = torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
    calls = {"prelude": lambda: runner.prelude([1], [8]),
             "block": lambda: runner.block(state, state, [8], [1]),
             "coda": lambda: runner.coda(state, [8], [model.config.depth])}
    with torch.inference_mode(), Counter():
        calls[kind]()
    return counts


@dataclass
class DecoderOperations:
    """The decoder's dispatched operations: per transformer layer and per call of each part
    outside its layers, in all and by class."""

    per_layer: int
    extras: dict[str, int]
    layer_by_class: dict[str, int]
    extras_by_class: dict[str, dict[str, int]]


def decoder_operations(models: list) -> DecoderOperations:
    """Operations per layer and per part, from op counts of models with different numbers of
    core layers: when the models share one, the smallest is counted again with one more (built
    on its device, in its dtype; weights do not change what is dispatched)."""
    from wfd.checkpoint import build

    if len({m.config.core_layers for m in models}) == 1:
        small = min(models, key=lambda m: sum(p.numel() for p in m.parameters()))
        param = next(small.parameters())
        models = [*models, build(small.config.model_copy(
            update={"core_layers": small.config.core_layers + 1}), device=param.device,
            dtype=param.dtype)]

    def layers(model, kind: str) -> int:
        cfg = model.config
        return {"prelude": cfg.prelude_layers, "block": cfg.core_layers,
                "coda": cfg.coda_layers}[kind]

    counts = {kind: [(layers(model, kind), count_ops(model, kind)) for model in models]
              for kind in ("prelude", "block", "coda")}
    (l0, c0), *_, (l1, c1) = sorted(counts["block"], key=lambda pair: pair[0])
    layer = {k: round((c1[k] - c0[k]) / (l1 - l0)) for k in c1}
    extras = {kind: {k: max(0, round(sum(c[k] - n * layer[k] for n, c in pairs) / len(pairs)))
                     for k in layer}
              for kind, pairs in counts.items()}
    return DecoderOperations(per_layer=sum(layer.values()),
                             extras={kind: sum(ops.values()) for kind, ops in extras.items()},
                             layer_by_class=layer, extras_by_class=extras)


def operation_host_weights(device: str, dtype: str, calls: int = 400) -> dict[str, float]:
    """Each operation class's host time relative to an elementwise operation's: a loop of one
    operation on tiny tensors, dispatched eagerly (on a GPU the host's time: each launch is
    longer than the kernel it starts), the best of five loops per class."""
    import torch.nn.functional as F

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = torch.device(device)
    x = torch.randn(1, 64, dtype=dt, device=dev)
    w = torch.randn(64, 64, dtype=dt, device=dev)
    q = torch.randn(1, 4, 1, 16, dtype=dt, device=dev)
    kv = torch.randn(1, 4, 8, 16, dtype=dt, device=dev)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool, device=dev)
    ops = {"matmul": lambda: F.linear(x, w),
           "attention": lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
           "other": lambda: x * x,
           "view": lambda: x.view(64)}

    def loop(fn) -> None:
        for _ in range(calls):
            fn()

    with torch.inference_mode():
        seconds = {kind: _best_time(lambda fn=fn: loop(fn), dev, 5) / calls
                   for kind, fn in ops.items()}
    return {kind: t / seconds["other"] for kind, t in seconds.items()}


def graph_replay_costs(device: str, kernels: int = 64, replays: int = 200,
                       capture: bool | None = None) -> tuple[float, float]:
    """(seconds per replayed call, device seconds per kernel replayed) of tiny captured calls,
    served as the decoder serves a call (wfd.graphs: inputs copied into the shape's buffers, the
    graph replayed, the output copied out): a one-kernel call is the host's replay cost; each
    kernel more adds the device's floor per kernel once the replay is device-bound. The priors
    of a graphs-mode prediction from an eager calibration. ``capture``: CUDA graphs (default on
    CUDA; without, the same calls run from the static buffers)."""
    from wfd.graphs import CallGraphs

    dev = torch.device(device)
    graphs = CallGraphs(dev.type == "cuda" if capture is None else capture, dev)
    x = torch.randn(1, 64, device=dev)

    def per_replay(n: int) -> float:
        def chain(position: torch.Tensor, slot: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for _ in range(n):
                y = y * 1.0
            return y

        def call() -> None:  # a position copied in, a slot kept, a state copied in: a B call's
            graphs.run(("microbenchmark", n), chain, [8], [x], lambda replay: (replay(), 0.0),
                       constants=lambda: [torch.zeros(1, dtype=torch.long, device=dev)])

        call()  # captured (or prepared) once

        def loop() -> None:
            for _ in range(replays):
                call()

        return _best_time(loop, dev, 5) / replays

    with torch.inference_mode():
        one, many = per_replay(1), per_replay(kernels + 1)
    return one, max(0.0, (many - one) / kernels)


# The preset each family's dispatch is counted on (the counts do not depend on widths).
FAMILY_PRESETS = {"huginn": "huginn-3.5b", "ouro": "ouro-2.6b"}


def narrow_model(preset: str, dtype: str):
    """A random model of ``preset``'s layers, heads ratio and options at small widths: it
    dispatches what the preset does (the counts do not depend on widths)."""
    from costmodel.presets import get_model
    from wfd.checkpoint import DTYPES, build
    from wfd.config import ModelConfig

    cfg = ModelConfig.from_spec(get_model(preset))
    heads = max(1, cfg.num_heads // cfg.num_kv_heads)  # keep grouped-query attention
    narrow = cfg.model_copy(update={"hidden_size": 64, "num_heads": 2 * heads,
                                    "num_kv_heads": 2, "head_dim": 32, "mlp_size": 128})
    return build(narrow, dtype=DTYPES[dtype])


def family_operations(dtype: str = "bf16") -> dict[str, dict[str, dict[str, int]]]:
    """Per family, this decoder's operations by class per layer and per call of each part
    outside its layers, as ``costmodel/data/operations.json`` stores them for pricing presets."""
    counted = {}
    for family, preset in FAMILY_PRESETS.items():
        ops = decoder_operations([narrow_model(preset, dtype)])
        counted[family] = {"layer": ops.layer_by_class, **ops.extras_by_class}
    return counted
