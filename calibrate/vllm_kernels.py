"""The kernels vLLM launches per layer and per part for each family, counted in its own forward
pass through the plugin (wfd.serving): what `costmodel predict --engine vllm` prices vLLM's AR
with.

    python -m calibrate.vllm_kernels --write costmodel/data/vllm_operations.json

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

import argparse
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

# the model's methods, by the part whose work they do (compute_logits: the head, after forward)
PARTS = {"prelude": "prelude", "initial_state": "prelude", "step": "block",
         "readout": "coda", "compute_logits": "coda"}
LAYER = re.compile(r"(transformer\.(prelude|core_block|coda)|model\.layers)\.\d+$")


def count_forward(model, run_step) -> dict[str, Counter]:
    """Kernels by part ("PART:layer" inside its transformer layers, "PART:own" outside them) and
    class, during the last decode step ``run_step`` makes."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from .operations import operation_class

    counts: dict[str, Counter] = {}
    part: list[str] = []  # the part whose method runs
    in_layer = [0]  # > 0 inside a transformer layer
    in_vllm_layer = [0]  # > 0 while one of vLLM's layers runs (its work counted as a whole)

    def credit(kind: str, n: int = 1) -> None:
        if part:
            key = f"{part[-1]}:{'layer' if in_layer[0] else 'own'}"
            counts.setdefault(key, Counter())[kind] += n

    def kernels_of(module) -> tuple[str, int] | None:
        if isinstance(module, (LinearBase, LogitsProcessor)):
            return "matmul", 1
        if isinstance(module, Attention):
            return "attention", 2
        if type(module).__module__.startswith("vllm.model_executor.layers"):
            return "other", 1
        return None

    hooks = []
    for name, module in model.named_modules():
        kind, layer = kernels_of(module), bool(LAYER.search(name))

        def pre(mod, args, kind=kind, layer=layer):
            in_layer[0] += layer
            if kind is not None:
                if in_vllm_layer[0] == 0:
                    credit(*kind)
                in_vllm_layer[0] += 1

        def post(mod, args, out, kind=kind, layer=layer):
            in_layer[0] -= layer
            in_vllm_layer[0] -= kind is not None

        hooks += [module.register_forward_pre_hook(pre),
                  module.register_forward_hook(post)]
    originals = {method: getattr(model, method) for method in PARTS}

    def marked(method: str):
        def run(*args, **kwargs):
            part.append(PARTS[method])
            try:
                return originals[method](*args, **kwargs)
            finally:
                part.pop()
        return run

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if in_vllm_layer[0] == 0:  # as this decoder's own operations are told apart
                credit(operation_class(func, args, out))
            return out

    hooks.append(model.register_forward_pre_hook(lambda mod, args: counts.clear()))
    for method in PARTS:
        setattr(model, method, marked(method))
    try:
        with Ops():
            run_step()
    finally:
        for hook in hooks:
            hook.remove()
        for method in PARTS:
            delattr(model, method)
    return counts


def family_kernels(preset: str) -> dict[str, dict[str, int]]:
    """Per layer ("layer") and per call of each part outside its layers, by class."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from wfd.checkpoint import save

    from .operations import narrow_model

    narrow = narrow_model(preset, "fp32")
    cfg = narrow.config
    with tempfile.TemporaryDirectory() as tmp:
        save(narrow, tmp)
        llm = LLM(model=tmp, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=64)
        params = SamplingParams(temperature=0, max_tokens=2, detokenize=False, ignore_eos=True)

        def step() -> None:  # the prefill's forward, then one decode step's (the last watched)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)

        (counted,) = llm.apply_model(lambda model: count_forward(model, step))
    layers = {"block": cfg.core_layers * cfg.depth}  # the core layers' calls in a step
    per_layer = {kind: n // layers["block"] for kind, n in counted["block:layer"].items()}
    table = {"layer": {k: per_layer.get(k, 0) for k in ("matmul", "attention", "other", "view")}}
    for part in ("prelude", "block", "coda"):
        own = counted.get(f"{part}:own", Counter())
        calls = cfg.depth if part == "block" else 1
        table[part] = {k: own.get(k, 0) // calls for k in ("matmul", "attention", "other",
                                                           "view")}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", default=None, help="write the table to this JSON file")
    args = parser.parse_args()
    data = {"command": "python -m calibrate.vllm_kernels --write "
                       "costmodel/data/vllm_operations.json",
            "families": {family: family_kernels(preset)
                         for family, preset in (("huginn", "huginn-3.5b"),
                                                ("ouro", "ouro-2.6b"))}}
    text = json.dumps(data, indent=1) + "\n"
    if args.write:
        Path(args.write).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
