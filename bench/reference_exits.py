"""Check this project's Huginn exits against the public reference's adaptive compute.

Not a test by itself: it needs transformers 4.53.x and the reference modeling files, which the
project does not ship. Run it in a scratch environment that has both, with this repository
importable (``tests/test_reference_exits.py`` runs it when that environment is named):

    PYTHONPATH=. python bench/reference_exits.py --huginn-ref DIR [--kv reference|latest]

DIR is a folder importable as a package holding raven_modeling_minimal.py and
raven_config_minimal.py (seal-rg/recurrent-pretraining, recpre/). For each checkpoint seed it
builds a tiny random Huginn in the public layout, well conditioned (its core's residual
branches scaled by --damp: the recurrence converges, so tokens really exit), saves it, loads
that folder into the reference class, and for each criterion and threshold compares the
greedy tokens of the reference ``generate_with_adaptive_compute`` (zero initial state, prompt
at full depth, its default cache) with ``wfd``'s AR, DtV and WFD (``--schedules``) with the
same rule and ``--exit-kv`` (default: reference, the public code's rule). Prints a table of
each case (tokens equal and the first difference per schedule, the exit depths on both sides)
and exits 1 when any run differs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch

from costmodel.clitools import script_main
from costmodel.exits import ExitRule
from wfd.checkpoint import build, init_random, load_folder, save
from wfd.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_parity import TINY, import_reference  # noqa: E402

# (ours, the reference's criterion name, threshold): where tokens exit at 2 to 7 of 8 steps
CASES = [("kl", "kl", 0.01), ("kl", "kl", 0.1), ("entropy-diff", "entropy-diff", 0.01),
         ("latent-diff", "latent-diff", 0.5), ("argmax-stable", "argmax-stability", 2)]
DEPTH = 8


class CountingEvaluator:
    """The reference's exit evaluator for a criterion, counting the steps each token runs
    (checked from the first step on: one check a step until it exits)."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def init(self, latents):
        self.steps.append(0)
        self.inner.init(latents)

    def check(self, model, latents, aux_inputs):
        self.steps[-1] += 1
        return self.inner.check(model, latents, aux_inputs)


def reference_run(package: str, folder: Path, prompt: list[int], criterion: str,
                  threshold: float, new_tokens: int) -> tuple[list[int], list[int]]:
    """(new tokens, steps each decoded token ran) of the reference's adaptive compute."""
    modeling = importlib.import_module(f"{package}.raven_modeling_minimal")
    from transformers import GenerationConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # its buffers are not in the checkpoint: a warning a load

    model = modeling.RavenForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    evaluator = CountingEvaluator(modeling.get_adaptive_exit_evaluator(model, criterion,
                                                                       threshold))
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    with torch.no_grad():
        out = model.generate_with_adaptive_compute(
            torch.tensor([prompt]), config, criterion=criterion, exit_threshold=threshold,
            init_scale=0.0, do_not_exit_in_prefill=True, exit_evaluator=evaluator,
            num_steps=DEPTH, max_new_tokens=new_tokens)
    # the prompt's pass checks nothing (prefill at full depth): its count is 0
    return out[0, len(prompt):].tolist(), evaluator.steps[1:new_tokens]


def damp(model, scale: float):
    """The core's residual branches (attention and MLP outputs) scaled by ``scale``."""
    with torch.no_grad():
        for layer in model.transformer.core_block:
            layer.attn.proj.weight.mul_(scale)
            layer.mlp.proj.weight.mul_(scale)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--huginn-ref", required=True)
    parser.add_argument("--kv", choices=["reference", "latest"], default="reference")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--damp", type=float, default=0.3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--schedules", nargs="+", choices=["ar", "dtv", "wfd"],
                        default=["ar", "dtv", "wfd"])
    args = parser.parse_args()
    package = import_reference(args.huginn_ref)
    cfg = TINY["huginn"].model_copy(update={"default_depth": DEPTH})
    heads = " | ".join(f"{s.upper()}: tokens equal (first difference)" for s in args.schedules)
    print(f"| seed | rule | {heads} | our exit depths | reference's |\n"
          f"|---|---|{'---|' * len(args.schedules)}---|---|")
    differ = 0
    for seed in args.seeds:
        ours = damp(init_random(build(cfg, init_scale=0.0), seed=seed), args.damp)
        prompt = torch.randint(0, cfg.vocab_size, (12,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        with tempfile.TemporaryDirectory() as tmp:
            save(ours, tmp)
            loaded = load_folder(tmp, init_scale=0.0)
            for name, criterion, threshold in CASES:
                theirs, steps = reference_run(package, Path(tmp), prompt, criterion, threshold,
                                              args.new_tokens)
                rule = ExitRule.parse(f"{name}:{threshold}", kv=args.kv)
                cells = []
                for schedule in args.schedules:
                    run = generate(loaded, prompt, max_new_tokens=args.new_tokens,
                                   schedule=schedule, exit_rule=rule, record=False)
                    first = next((i for i, (a, b) in enumerate(
                        zip(run.tokens, theirs, strict=True)) if a != b), None)
                    differ += first is not None
                    cells.append("yes" if first is None else f"no ({first})")
                depths = run.stats["exit_depths"]  # every schedule's are AR's (tests)
                print(f"| {seed} | `{rule.label}` | {' | '.join(cells)} | "
                      f"{min(depths)}-{max(depths)} (mean {sum(depths) / len(depths):.2f}) | "
                      f"{min(steps)}-{max(steps)} (mean {sum(steps) / len(steps):.2f}) |")
    print(f"\n{differ} of {len(args.seeds) * len(CASES) * len(args.schedules)} runs differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    script_main(main)
