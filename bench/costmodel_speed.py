"""How fast the cost model is: vectorized sweep throughput and cold CLI start time.

    python bench/costmodel_speed.py [--points 1000000] [--cli-runs 10]

Prints a Markdown table (record it in docs/costmodel.md with this command).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

from costmodel import sweep


def sweep_throughput(points: int, repeats: int = 3) -> float:
    rng = np.random.default_rng(0)
    width = rng.integers(2, 33, points)
    acceptance = rng.uniform(0.5, 1.0, points)
    context = rng.integers(128, 16384, points)
    bandwidth = rng.uniform(0.5e12, 5e12, points)
    batch = rng.integers(1, 9, points)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sweep("huginn-3.5b", "a6000", width=width, acceptance=acceptance, context=context,
              bandwidth_bytes_per_s=bandwidth, batch=batch)
        times.append(time.perf_counter() - start)
    return points / statistics.median(times)


def cli_start(runs: int) -> float:
    cmd = [sys.executable, "-m", "costmodel", "predict", "--bandwidth", "768GB/s", "--width", "8"]
    subprocess.run(cmd, capture_output=True, check=True)  # warm the file cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--cli-runs", type=int, default=10)
    args = parser.parse_args()
    rate = sweep_throughput(args.points)
    start = cli_start(args.cli_runs)
    print("| measure | value |\n|---|---|")
    print(f"| sweep throughput (AR + DtV best k in 1..32 + WFD, {args.points:,} random points, "
          f"huginn-3.5b) | {rate:,.0f} points/s |")
    print(f"| `costmodel predict --bandwidth 768GB/s --width 8`, wall time (median of "
          f"{args.cli_runs}) | {start * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
