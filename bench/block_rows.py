"""Block-call time by positions per call, timed alone as `costmodel calibrate` times them: how a
CPU library's code paths (vector products, a blocked kernel on one thread, on all threads) show
in whole calls, and whether they hold from one round to the next on a shared machine.

    python bench/block_rows.py [--model ouro-base:random] [--context 88] [--rounds 2]
        [--positions 1 2 3 4 5 6 8 12 16 32]

Prints a Markdown table: ms per call (median of 7 after 2 warm-up calls), one row per round.
"""

from __future__ import annotations

import argparse

from calibrate.measure import Grid, time_call
from wfd.checkpoint import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ouro-base:random")
    parser.add_argument("--context", type=int, default=88)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--positions", type=int, nargs="+",
                        default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 32])
    args = parser.parse_args()
    model = load_model(args.model, device="cpu", dtype="fp32")
    grid = Grid(positions=[1], contexts=[args.context], repeats=7, warmup=2)
    print(f"{args.model}, context {args.context}: ms per block call at one depth\n")
    print("| round | " + " | ".join(f"{n}" for n in args.positions) + " |")
    print("|---" * (len(args.positions) + 1) + "|")
    for round_index in range(1, args.rounds + 1):
        times = [time_call(model, args.model, "block", n, args.context, 1, grid).median_s
                 for n in args.positions]
        print(f"| {round_index} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
