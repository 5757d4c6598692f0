"""AR vs DtV (best k) vs WFD tokens/s on this machine, and the cost of one block call vs the
number of positions in it.

    python bench/decode_speed.py schedules [--models huginn-tiny ouro-tiny huginn-mid:random
        ouro-mid:random] [--repeats 5] [--new-tokens 64] [--acceptance 0.9] [--threads 2]
    python bench/decode_speed.py block-calls [--model huginn-mid:random] [--dtype fp32 bf16]
        [--threads 1 2]

Runs are interleaved (each repeat runs every schedule once, in turn) and the median is reported.
A trained model decodes for real; a random-weight model (PRESET:random) uses the forced-acceptance
mode at --acceptance, which times the schedule without a real decode (flagged in the table).
Prints Markdown tables for docs/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from costmodel.plans import default_draft_depth, wave_width
from wfd.checkpoint import load_model
from wfd.generate import generate, make_cache, prefill
from wfd.runtime import Runner

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        ",
    "    for i, line in enumerate(lines):\n        if ",
]


def time_schedule(model, schedule: str, new_tokens: int, forced: float | None,
                  prompts: int = len(PROMPTS), **kw) -> tuple[float, dict]:
    """Tokens per second over the prompts (prefill included, as the WFD paper reports)."""
    tokens, wall, accepted = 0, 0.0, []
    for text in PROMPTS[:prompts]:
        ids = list(text.encode())
        res = generate(model, ids, schedule=schedule, max_new_tokens=new_tokens,
                       force_acceptance=forced if schedule != "ar" else None, record=False, **kw)
        tokens += len(res.tokens)
        wall += res.wall_s
        if res.stats.get("acceptance") is not None:
            accepted.append(res.stats["acceptance"])
    return tokens / wall, {"acceptance": statistics.mean(accepted) if accepted else None}


def schedules(args) -> None:
    torch.set_num_threads(args.threads)
    print(f"| model | dtype | schedule | tokens/s (median of {args.repeats}) | speedup vs AR | "
          "acceptance | decode |\n|---|---|---|---|---|---|---|")
    for name in args.models:
        model = load_model(name, dtype=args.dtype)
        forced = args.acceptance if name.endswith(":random") else None
        depth = model.config.depth
        d = args.draft_depth or default_draft_depth(depth)
        configs = {"AR": ("ar", {})}
        for k in args.block_lengths:
            configs[f"DtV k={k} d={d}"] = ("dtv", {"block_length": k, "draft_depth": d})
        configs[f"WFD d={d} W={wave_width(depth, d)}"] = ("wfd", {"draft_depth": d})
        rates: dict[str, list[float]] = {label: [] for label in configs}
        info: dict[str, dict] = {}
        time_schedule(model, "ar", 4, None)  # warm-up
        for _ in range(args.repeats):
            for label, (schedule, kw) in configs.items():
                rate, info[label] = time_schedule(model, schedule, args.new_tokens, forced,
                                                  args.prompts, **kw)
                rates[label].append(rate)
        ar = statistics.median(rates["AR"])
        best_dtv = max((label for label in rates if label.startswith("DtV")),
                       key=lambda lab: statistics.median(rates[lab]))
        for label, values in rates.items():
            if label.startswith("DtV") and label != best_dtv:
                continue
            med = statistics.median(values)
            acc = info[label].get("acceptance")
            print(f"| {name} | {args.dtype} | {label} | {med:.1f} | {med / ar:.2f}x | "
                  f"{'' if acc is None else f'{acc:.2f}'} | "
                  f"{'forced acceptance' if forced is not None and label != 'AR' else 'real'} |")


@torch.inference_mode()
def block_calls(args) -> None:
    print("| model | dtype | threads | positions per call | ms per block call | x one position |"
          "\n|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype)
        depth = model.config.depth
        for threads in args.threads_list:
            torch.set_num_threads(threads)
            base = None
            for n in args.positions:
                prompt = [32 + i % 200 for i in range(args.context)]
                cache = make_cache(model, prompt_len=len(prompt), max_new_tokens=n + 1,
                                   depth=depth, kv_sharing=0, readout_depths=[depth])
                runner = Runner(model, cache, record=False)
                prefill(runner, prompt, depth, [depth])
                positions = list(range(len(prompt), len(prompt) + n))
                e, state = runner.prelude([65] * n, positions)
                times = []
                for rep in range(args.repeats + 2):
                    cache.truncate(len(prompt))  # the same call again, at the same context
                    t0 = time.perf_counter()
                    runner.block(state, e, positions, [1] * n)
                    if rep >= 2:  # two warm-up calls
                        times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3
                base = base or ms
                print(f"| {args.model} | {dtype} | {threads} | {n} | {ms:.2f} | "
                      f"{ms / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("schedules")
    s.add_argument("--models", nargs="+", default=["huginn-tiny", "ouro-tiny",
                                                   "huginn-mid:random", "ouro-mid:random"])
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--acceptance", type=float, default=0.9)
    s.add_argument("--draft-depth", type=int, default=None)
    s.add_argument("--block-lengths", type=int, nargs="+", default=[2, 4, 8])
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--prompts", type=int, default=len(PROMPTS))
    s.add_argument("--dtype", default="fp32")
    b = sub.add_parser("block-calls")
    b.add_argument("--model", default="huginn-mid:random")
    b.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    b.add_argument("--threads-list", type=int, nargs="+", default=[1, 2])
    b.add_argument("--positions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b.add_argument("--context", type=int, default=256)
    b.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    schedules(args) if args.what == "schedules" else block_calls(args)


if __name__ == "__main__":
    main()
