"""Check this project's Huginn and Ouro models against the public reference implementations.

Not a test: it needs transformers 4.54.1 and the reference modeling files, which the project does
not ship. Run it in a scratch environment that has both and this package installed:

    python bench/reference_parity.py --huginn-ref DIR --ouro-ref DIR

DIR is a folder importable as a package: for Huginn it holds raven_modeling_minimal.py and
raven_config_minimal.py (seal-rg/recurrent-pretraining, recpre/); for Ouro modeling_ouro.py and
configuration_ouro.py (e.g. LoopedLMs/ouro_rl, ouro_rl/modeling/). For each family it builds a
tiny random model in the public layout, saves it as a checkpoint folder, loads that folder into
the reference class, and compares fp32 logits of one forward over a random prompt, at every
depth, with ours (from the full forward and from cached token-by-token decoding).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch

from costmodel.clitools import script_main
from wfd.checkpoint import build, init_random, load_folder, save
from wfd.config import ModelConfig
from wfd.generate import full_forward, make_cache, prefill
from wfd.runtime import Runner

TINY = {
    "huginn": ModelConfig(family="huginn", hidden_size=96, num_heads=4, num_kv_heads=4,
                          head_dim=24, mlp_size=160, vocab_size=128, prelude_layers=2,
                          core_layers=2, coda_layers=2, default_depth=6, max_position_embeddings=64,
                          rope_base=50000.0, qk_bias=True, tied_head=True),
    "ouro": ModelConfig(family="ouro", hidden_size=96, num_heads=4, num_kv_heads=4,
                        head_dim=24, mlp_size=160, vocab_size=128, prelude_layers=0,
                        core_layers=3, coda_layers=0, default_depth=4, max_position_embeddings=64,
                        rope_base=1e6, exit_gate=True),
}


def import_reference(folder: str):
    path = Path(folder).resolve()
    sys.path.insert(0, str(path.parent))
    return path.name


def reference_logits(family: str, package: str, folder: Path, tokens: torch.Tensor, depth: int
                     ) -> dict[int, torch.Tensor]:
    if family == "huginn":
        mod = importlib.import_module(f"{package}.raven_modeling_minimal")
        model = mod.RavenForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        out = {}
        for r in range(1, depth + 1):
            with torch.no_grad():
                res = model(tokens[None], num_steps=r, init_scale=0.0)
            out[r] = res.logits[0].float()
        return out
    mod = importlib.import_module(f"{package}.modeling_ouro")
    model = mod.OuroForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = {}
    for step in range(depth):
        with torch.no_grad():
            res = model(tokens[None], exit_at_step=step, use_cache=False)
        out[step + 1] = res.logits[0].float()
    return out


def cached_logits(model, tokens: list[int], depth: int) -> dict[int, torch.Tensor]:
    """Each prefix's last-position logits, decoding token by token through the cache."""
    cache = make_cache(model, prompt_len=1, max_new_tokens=len(tokens), depth=depth,
                       kv_sharing=0, readout_depths=list(range(1, depth + 1)))
    runner = Runner(model, cache, record=False)
    rows: dict[int, list[torch.Tensor]] = {r: [] for r in range(1, depth + 1)}
    first = prefill(runner, tokens[:1], depth, list(range(1, depth + 1)))
    for r in rows:
        rows[r].append(first[r])
    for p in range(1, len(tokens)):
        e, state = runner.prelude([tokens[p]], [p])
        for r in range(1, depth + 1):
            state = runner.block(state, e, [p], [r])
            rows[r].append(runner.coda(state, [p], [r])[0])
    return {r: torch.stack(v) for r, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--huginn-ref", required=True)
    parser.add_argument("--ouro-ref", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    print("| family | depth | max abs diff, full forward | max abs diff, cached decode | "
          "max abs logit |\n|---|---|---|---|---|")
    worst = 0.0
    for family, ref in (("huginn", args.huginn_ref), ("ouro", args.ouro_ref)):
        package = import_reference(ref)
        cfg = TINY[family]
        ours = init_random(build(cfg, init_scale=0.0), seed=args.seed)
        tokens = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(
            args.seed))
        with tempfile.TemporaryDirectory() as tmp:
            save(ours, tmp)
            loaded = load_folder(tmp, init_scale=0.0)
            theirs = reference_logits(family, package, Path(tmp), tokens, cfg.depth)
        full = full_forward(loaded, tokens.tolist(), cfg.depth, list(range(1, cfg.depth + 1)))
        cached = cached_logits(loaded, tokens.tolist(), cfg.depth)
        for r in range(1, cfg.depth + 1):
            d_full = (full[r] - theirs[r]).abs().max().item()
            d_cached = (cached[r] - theirs[r]).abs().max().item()
            worst = max(worst, d_full, d_cached)
            print(f"| {family} | {r} | {d_full:.2e} | {d_cached:.2e} | "
                  f"{theirs[r].abs().max().item():.2f} |")
    print(f"\nworst difference: {worst:.2e}")
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    script_main(main)
