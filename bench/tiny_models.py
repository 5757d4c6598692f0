"""Measure the shipped tiny models on held-out text, and write their model cards.

    python bench/tiny_models.py [--models huginn-tiny ouro-tiny] [--windows 24] [--prompts 8]
        [--new-tokens 64] [--write-cards]

For each model: bits per byte at each depth and the rate at which the greedy readout at depth d
equals the readout at full depth R (held-out windows of 256 bytes, the training script's split),
and the acceptance WFD achieves when generating from held-out prompts (greedy, d = ceil(R / 8)).
Prints Markdown tables; with --write-cards, writes wfd/models/NAME/README.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from costmodel.plans import default_draft_depth
from wfd.checkpoint import SHIPPED_DIR, load_model
from wfd.generate import generate
from wfd.train import evaluate, load_corpus


def heldout_prompts(data: bytes, count: int, length: int = 128) -> list[list[int]]:
    """Prompts cut at line starts spread over the held-out text."""
    step = len(data) // (count + 1)
    prompts = []
    for i in range(1, count + 1):
        start = data.find(b"\n", i * step) + 1
        prompts.append(list(data[start:start + length]))
    return prompts


def wfd_acceptance(model, prompts: list[list[int]], new_tokens: int, draft_depth: int) -> dict:
    accepted = verified = 0
    equal = True
    for prompt in prompts:
        ar = generate(model, prompt, schedule="ar", max_new_tokens=new_tokens, record=False)
        wfd = generate(model, prompt, schedule="wfd", max_new_tokens=new_tokens,
                       draft_depth=draft_depth, record=False)
        equal &= ar.tokens == wfd.tokens
        accepted += wfd.stats["accepted"]
        verified += wfd.stats["drafts_verified"]
    return {"acceptance": accepted / verified, "drafts": verified, "wfd_equals_ar": equal}


def card(name: str, model, training: dict, metrics: dict, gen: dict, draft_depth: int) -> str:
    cfg = model.config
    bpb = metrics["bits_per_byte"]
    agree = metrics["agreement_with_full_depth"]
    rows = "\n".join(f"| {r} | {bpb[r - 1]:.3f} | {agree[r - 1]:.3f} |"
                     for r in range(1, cfg.depth + 1))
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    return f"""# {name}

A tiny {cfg.family.capitalize()}-family looped LM trained by this project, shipped so that WFD
runs with real drafts and real rejections on a laptop CPU.

- Architecture: {cfg.family}, hidden {cfg.hidden_size}, {cfg.num_heads} heads of
  {cfg.head_dim}, MLP {cfg.mlp_size}, byte vocabulary ({cfg.vocab_size}), prelude / core / coda
  layers {cfg.prelude_layers} / {cfg.core_layers} / {cfg.coda_layers}, default depth R =
  {cfg.depth}; {params:,} parameters, fp32 safetensors.
- Data: the `.py` files of the Python standard library of the training interpreter, split by
  file into train ({training['train_bytes']:,} bytes) and held-out ({training['heldout_bytes']:,}
  bytes) sets by a hash of the path (`wfd/train.py`).
- Training: `{training['command']}`; {training['steps']} steps in {training['minutes']} minutes
  on a 2-core CPU (one thread), torch {training['torch']}.

## Held-out measurements (`python bench/tiny_models.py --write-cards`)

| depth r | bits per byte | greedy agreement with depth {cfg.depth} |
|---|---|---|
{rows}

WFD (greedy, d = {draft_depth}) generating {gen['new_tokens']} tokens from {gen['prompts']}
held-out prompts: acceptance {gen['acceptance']:.3f} over {gen['drafts']} drafts; tokens equal to
AR: {gen['wfd_equals_ar']}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["huginn-tiny", "ouro-tiny"])
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-cards", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_corpus("heldout")
    heldout = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    prompts = heldout_prompts(data, args.prompts)
    for name in args.models:
        model = load_model(name)
        depth = model.config.depth
        d = default_draft_depth(depth)
        metrics = evaluate(model, heldout, depth, windows=args.windows)
        gen = {**wfd_acceptance(model, prompts, args.new_tokens, d),
               "prompts": len(prompts), "new_tokens": args.new_tokens}
        print(f"\n### {name}\n\n| depth | bits per byte | agreement with depth {depth} |\n"
              "|---|---|---|")
        for r in range(1, depth + 1):
            print(f"| {r} | {metrics['bits_per_byte'][r - 1]:.3f} | "
                  f"{metrics['agreement_with_full_depth'][r - 1]:.3f} |")
        print(f"\nWFD d={d}: acceptance {gen['acceptance']:.3f} over {gen['drafts']} drafts, "
              f"tokens equal to AR: {gen['wfd_equals_ar']}")
        if args.write_cards:
            folder = SHIPPED_DIR / name
            training = json.loads((folder / "training.json").read_text())
            (folder / "README.md").write_text(card(name, model, training, metrics, gen, d))
            (folder / "measurements.json").write_text(json.dumps(
                {"heldout": metrics, "wfd": gen, "draft_depth": d,
                 "agreement_at_draft_depth": metrics["agreement_with_full_depth"][d - 1]},
                indent=2) + "\n")


if __name__ == "__main__":
    main()
