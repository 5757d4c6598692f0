"""The kernels vLLM launches per layer and per part for each family, counted in its own forward
pass through the plugin (wfd.serving): what `costmodel predict --engine vllm` prices vLLM's AR
with (written, with this decoder's table, by `python -m calibrate.tables --write`).

Each family's preset (huginn-3.5b, ouro-2.6b) is built narrow (its layers, heads ratio and
options at small widths: the counts do not depend on widths), loaded into an engine in this
process, and one decode step's forward and head are watched: every call of one of vLLM's layers
counts as the kernels it launches on a GPU (a linear layer or the head one matrix product,
attention two: the cache update and the attention itself, a norm, rotary embedding, activation
or embedding one), and every tensor operation the model code runs outside those layers as one
kernel, or none for a view (told apart as calibrate.operations tells this decoder's). Each is
credited to the part whose method ran it (prelude and initial state, step, readout and logits),
inside its transformer layers or outside them.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from functools import partial

# the model's methods, by the part whose work they do (compute_logits: the head, after forward)
PARTS = {"prelude": "prelude", "initial_state": "prelude", "step": "block",
         "readout": "coda", "compute_logits": "coda"}
LAYER = re.compile(r"(transformer\.(prelude|core_block|coda)|model\.layers)\.\d+$")


def _vllm_kernels(module) -> tuple[str, int] | None:
    """(class, kernels) one of vLLM's layers launches on a GPU per call; None for another
    module."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if isinstance(module, (LinearBase, LogitsProcessor)):
        return "matmul", 1
    if isinstance(module, Attention):
        return "attention", 2
    # the plugin's own subclasses of vLLM's layers (wfd.serving.common.Norm) launch theirs
    if any(c.__module__.startswith("vllm.model_executor.layers") for c in type(module).__mro__):
        return "other", 1
    return None


class _KernelCounter:
    """Kernels by part and class, credited as a forward enters vLLM's layers and runs tensor
    operations, to the part whose method runs, inside its transformer layers or outside them."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}
        self.part: list[str] = []  # the part whose method runs
        self.in_layer = 0  # > 0 inside a transformer layer
        self.in_vllm_layer = 0  # > 0 while one of vLLM's layers runs (its work counted as a whole)

    def credit(self, kind: str, n: int = 1) -> None:
        if self.part:
            key = f"{self.part[-1]}:{'layer' if self.in_layer else 'own'}"
            self.counts.setdefault(key, Counter())[kind] += n

    def entering(self, kernels: tuple[str, int] | None, layer: bool, module, args) -> None:
        self.in_layer += layer
        if kernels is not None:
            if self.in_vllm_layer == 0:
                self.credit(*kernels)
            self.in_vllm_layer += 1

    def leaving(self, kernels: tuple[str, int] | None, layer: bool, module, args, out) -> None:
        self.in_layer -= layer
        self.in_vllm_layer -= kernels is not None

    def hook_modules(self, model) -> list:
        """Hooks on every module of ``model`` that follow the layers a forward enters and
        leaves; their handles."""
        hooks = []
        for name, module in model.named_modules():
            kernels, layer = _vllm_kernels(module), bool(LAYER.search(name))
            hooks += [module.register_forward_pre_hook(partial(self.entering, kernels, layer)),
                      module.register_forward_hook(partial(self.leaving, kernels, layer))]
        return hooks

    def marked(self, method: str, original):
        """``original``, the model's ``method``, with what it runs credited to its part."""
        def run(*args, **kwargs):
            self.part.append(PARTS[method])
            try:
                return original(*args, **kwargs)
            finally:
                self.part.pop()
        return run


def count_forward(model, run_step) -> dict[str, Counter]:
    """Kernels by part ("PART:layer" inside its transformer layers, "PART:own" outside them) and
    class, during the last decode step ``run_step`` makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .operations import operation_class

    counter = _KernelCounter()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if counter.in_vllm_layer == 0:  # as this decoder's own operations are told apart
                counter.credit(operation_class(func, args, out))
            return out

    hooks = counter.hook_modules(model)
    originals = {method: getattr(model, method) for method in PARTS}
    hooks.append(model.register_forward_pre_hook(lambda mod, args: counter.counts.clear()))
    for method in PARTS:
        setattr(model, method, counter.marked(method, originals[method]))
    try:
        with Ops():
            run_step()
    finally:
        for hook in hooks:
            hook.remove()
        for method in PARTS:
            delattr(model, method)
    return counter.counts


def family_kernels(preset: str) -> dict[str, dict[str, int]]:
    """Per layer ("layer") and per call of each part outside its layers, by class."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from wfd.checkpoint import save
    from wfd.serving.offline import settle_heap, shut_down

    from .operations import narrow_model

    narrow = narrow_model(preset, "fp32")
    cfg = narrow.config
    with tempfile.TemporaryDirectory() as tmp:
        save(narrow, tmp)
        settle_heap()
        llm = LLM(model=tmp, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=64)
        params = SamplingParams(temperature=0, max_tokens=2, detokenize=False, ignore_eos=True)

        def step() -> None:  # the prefill's forward, then one decode step's (the last watched)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)

        (counted,) = llm.apply_model(lambda model: count_forward(model, step))
        shut_down(llm)  # before the next family's engine starts
    layers = {"block": cfg.core_layers * cfg.depth}  # the core layers' calls in a step
    per_layer = {kind: n // layers["block"] for kind, n in counted["block:layer"].items()}
    table = {"layer": {k: per_layer.get(k, 0) for k in ("matmul", "attention", "other", "view")}}
    for part in ("prelude", "block", "coda"):
        own = counted.get(f"{part}:own", Counter())
        calls = cfg.depth if part == "block" else 1
        table[part] = {k: own.get(k, 0) // calls for k in ("matmul", "attention", "other",
                                                           "view")}
    return table
