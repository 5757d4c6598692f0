"""How approximate KV sharing below R is: the agreement of DtV and WFD with AR under the same
sharing, and their acceptance, on the shipped tiny models.

    python bench/kv_sharing.py [--models huginn-tiny ouro-tiny] [--slots 1 2 4] [--prompts 8]
        [--new-tokens 64] [--block-length 4]

With s < R shared slots per core layer, a past position contributes the KV it wrote last into the
slot a depth maps to (Huginn's compress-s cache). AR, DtV and WFD write those slots in different
orders (a wave leaves deeper positions' KV behind shallower ones'), so their greedy tokens may part
from AR's under the same sharing; s = R (0 here: one slot per depth) is exact. For each model and
s: the fraction of generated tokens equal to AR's position by position, the fraction before the
first difference, and each schedule's acceptance (held-out prompts, greedy, d = ceil(R / 8)).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from costmodel.predict import resolve_draft_depth
from wfd.checkpoint import load_model
from wfd.generate import generate

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import heldout_prompts, model_heldout  # noqa: E402

from costmodel.clitools import script_main


def agreement(a: list[int], b: list[int]) -> tuple[float, float]:
    """(fraction of positions with equal tokens, fraction before the first difference)."""
    n = min(len(a), len(b))
    equal = sum(x == y for x, y in zip(a, b, strict=False))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return equal / n, first / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["huginn-tiny", "ouro-tiny"])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=4)
    args = parser.parse_args()
    print("| model | shared slots s | schedule | tokens equal to AR's | before first difference |"
          " acceptance |\n|---|---|---|---|---|---|")
    for name in args.models:
        model = load_model(name)
        prompts = heldout_prompts(model_heldout(name), args.prompts)
        depth = model.config.depth
        d = resolve_draft_depth(model.config, depth, None, None)
        for s in args.slots:
            if s >= depth:
                continue
            rows = {"dtv": [], "wfd": []}
            for prompt in prompts:
                common = {"max_new_tokens": args.new_tokens, "kv_sharing": s, "record": False}
                ar = generate(model, prompt, schedule="ar", **common).tokens
                for schedule, extra in (("dtv", {"block_length": args.block_length}),
                                        ("wfd", {})):
                    res = generate(model, prompt, schedule=schedule, draft_depth=d, **common,
                                   **extra)
                    rows[schedule].append((*agreement(ar, res.tokens), res.stats["acceptance"]))
            for schedule, values in rows.items():
                equal, prefix, acc = (statistics.mean(v[i] for v in values) for i in range(3))
                label = f"DtV k={args.block_length} d={d}" if schedule == "dtv" else f"WFD d={d}"
                print(f"| {name} | {s} | {label} | {equal:.3f} | {prefix:.3f} | {acc:.3f} |")


if __name__ == "__main__":
    script_main(main)
