"""How steady this machine is: over a stretch of time, the per-product time of a blocked matrix
product (6 rows, the calibration's canary), of a one-row product (a vector product) over the same
matrices, and of a memory copy beyond the cache, sampled every --interval seconds.

    python bench/machine_noise.py [--seconds 90] [--interval 0.5] [--threads 2] [--tolerance 1.2]
                                  [--sustained]

Prints a Markdown table of quantiles (each relative to the fastest sample) and the spells during
which the blocked product ran more than --tolerance slower than its fastest: their count and
lengths. On a shared VM these spells are what `costmodel calibrate` waits out (wfd.timing.
Quiet). With ``--sustained`` the machine is kept busy between samples (the same products, on all
threads, instead of sleeping), as during a calibration or a long generation. The last column,
the spread (90th over 10th percentile), is what `costmodel calibrate` judges a calibration's
canary by.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from costmodel.clitools import script_main


def per_call(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1.2)
    parser.add_argument("--sustained", action="store_true",
                        help="keep the machine busy between samples instead of sleeping")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(2112, 768) for _ in range(8)]  # 6.5 MB each, 52 MB in all
    rows6, rows1 = torch.randn(6, 768), torch.randn(1, 768)
    src = torch.ones(16 * 2**20)  # 64 MB
    dst = torch.empty_like(src)
    series: dict[str, list[float]] = {"blocked product (6 rows)": [], "vector product (1 row)": [],
                                      "copy 64 MB": []}
    stamps = []
    start = time.time()
    while time.time() - start < args.seconds:
        stamps.append(time.time() - start)
        series["blocked product (6 rows)"].append(
            per_call(lambda: [F.linear(rows6, w) for w in weights], 2) / len(weights))
        series["vector product (1 row)"].append(
            per_call(lambda: [F.linear(rows1, w) for w in weights], 2) / len(weights))
        series["copy 64 MB"].append(per_call(lambda: dst.copy_(src), 2))
        if not args.sustained:
            time.sleep(args.interval)
            continue
        busy_until = time.time() + args.interval
        while time.time() < busy_until:
            for w in weights:
                F.linear(rows6, w)
    print(f"{len(stamps)} samples over {stamps[-1]:.0f} s, {args.threads} threads\n")
    print("| timed | fastest (us) | median / fastest | 90th pct / fastest | slowest / fastest | "
          "spread: 90th / 10th pct |\n|---|---|---|---|---|---|")
    for name, values in series.items():
        best = min(values)
        q = statistics.quantiles(values, n=10)
        print(f"| {name} | {best * 1e6:.0f} | {statistics.median(values) / best:.2f} | "
              f"{q[-1] / best:.2f} | {max(values) / best:.2f} | {q[-1] / q[0]:.2f} |")
    blocked = series["blocked product (6 rows)"]
    best = min(blocked)
    spells, current = [], None
    for t, value in zip(stamps, blocked, strict=True):
        slow = value > args.tolerance * best
        if slow and current is None:
            current = t
        if not slow and current is not None:
            spells.append(t - current)
            current = None
    if current is not None:
        spells.append(stamps[-1] - current)
    slow_share = sum(v > args.tolerance * best for v in blocked) / len(blocked)
    lasting = (f", lasting {min(spells):.1f} to {max(spells):.1f} s (median "
               f"{statistics.median(spells):.1f} s)" if spells else "")
    print(f"\nblocked product more than {args.tolerance}x its fastest: {slow_share:.0%} of "
          f"samples, {len(spells)} spells{lasting}")


if __name__ == "__main__":
    script_main(main)
