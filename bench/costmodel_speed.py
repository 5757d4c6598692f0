"""How fast the cost model is: vectorized sweep throughput on two grids and on scattered points,
and the cold CLI start time (whole processes) beside a stand-in command on the same libraries.

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
from costmodel.clitools import script_main

GRIDS = {
    "31 widths x 20,000 acceptances": dict(width=np.arange(2, 33)[:, None],
                                          acceptance=np.linspace(0.5, 1.0, 20_000)[None, :]),
    "31 widths x 2,000 acceptances x 5 contexts x 2 batches": dict(
        width=np.arange(2, 33)[:, None, None, None],
        acceptance=np.linspace(0.5, 1.0, 2_000)[None, :, None, None],
        context=np.array([256, 1024, 2048, 4096, 8192])[None, None, :, None],
        batch=np.array([1, 8])[None, None, None, :]),
}


def sweep_rate(repeats: int = 5, **axes) -> tuple[int, float]:
    """(points, points per second: the median of ``repeats`` sweeps) of one sweep."""
    points = int(np.prod(np.broadcast_shapes(*(np.shape(a) for a in axes.values()))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sweep("huginn-3.5b", "a6000", **axes)
        times.append(time.perf_counter() - start)
    return points, points / statistics.median(times)


def scattered(points: int) -> dict[str, np.ndarray]:
    """Random points, every axis drawn per point: each point's calls priced on their own."""
    rng = np.random.default_rng(0)
    return dict(width=rng.integers(2, 33, points), acceptance=rng.uniform(0.5, 1.0, points),
                context=rng.integers(128, 16384, points),
                bandwidth_bytes_per_s=rng.uniform(0.5e12, 5e12, points),
                batch=rng.integers(1, 9, points))


# A command on the stack `costmodel predict` stands on, with none of the cost model's code:
# numpy imported, one pydantic model validated, and a typer command with as many options as
# predict's (typer builds a pydantic adapter for each). Its start is the floor predict's own
# code adds to.
STAND_IN = """
import inspect, numpy, pydantic, typer
class Spec(pydantic.BaseModel):
    x: float
def command(**options):
    print(Spec(x=numpy.float64(len(options))).x)
command.__signature__ = inspect.Signature([inspect.Parameter(
    f"option_{i}", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=str | None)
    for i in range(OPTIONS)])
app = typer.Typer(add_completion=False)
app.callback()(lambda: None)
app.command("predict")(command)
app()
"""


def cli_start(runs: int) -> tuple[list[float], list[float], int]:
    """(wall times of whole `costmodel predict` processes, of the stand-in's, predict's
    options), runs alternated."""
    import inspect

    from costmodel.cli import predict_cmd

    options = len(inspect.signature(predict_cmd).parameters)
    commands = ([sys.executable, "-m", "costmodel", "predict", "--bandwidth", "768GB/s",
                 "--width", "8"],
                [sys.executable, "-c", STAND_IN.replace("OPTIONS", str(options)), "predict",
                 "--option-0", "768GB/s", "--option-1", "8"])
    for cmd in commands:
        subprocess.run(cmd, capture_output=True, check=True)  # warm the file cache
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for cmd, each in zip(commands, times, strict=True):
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True)
            each.append(time.perf_counter() - start)
    return times[0], times[1], options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", type=int, default=1_000_000,
                        help="random points of the scattered sweep")
    parser.add_argument("--cli-runs", type=int, default=10)
    args = parser.parse_args()
    print("| measure | value |\n|---|---|")
    for label, axes in {**GRIDS, f"{args.points:,} random points (every axis per point)":
                        scattered(args.points)}.items():
        points, rate = sweep_rate(**axes)
        print(f"| sweep (AR + DtV best k in 1..32 + WFD, huginn-3.5b), {label}: {points:,} "
              f"points, median of 5 | {rate:,.0f} points/s |")
    start, floor, options = cli_start(args.cli_runs)

    def ms(times: list[float]) -> str:
        return (f"{statistics.median(times) * 1e3:.0f} ms ({min(times) * 1e3:.0f}-"
                f"{max(times) * 1e3:.0f})")

    print(f"| `costmodel predict --bandwidth 768GB/s --width 8`, wall time (median and range "
          f"of {args.cli_runs}) | {ms(start)} |")
    print(f"| the stack's floor: numpy, a pydantic model and a typer command of {options} "
          f"options (STAND_IN), alternated with the above | {ms(floor)} |")


if __name__ == "__main__":
    script_main(main)
