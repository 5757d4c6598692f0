"""How far apart two calibrations measured the same calls: the floor under any per-call error.

    python bench/calibration_repeatability.py PROFILE PROFILE [PROFILE ...]

For each pair of profiles, the held-out calls both measured (same model, part, positions, context
and slots) are compared: the median and 90th percentile of |time in one / time in the other - 1|,
over all of them and without the tiny models (whose calls are overhead-bound). Prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

from costmodel.clitools import script_main
from costmodel.profile import load_profile


def call_times(path: Path) -> dict[tuple[str, str], float]:
    profile = load_profile(path)
    return {(p.model, p.label): p.measured_s for p in profile.validation if p.kind == "call"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", type=Path, nargs="+")
    args = parser.parse_args()
    if len(args.profiles) < 2:
        parser.error("give at least two profiles")
    times = {path: call_times(path) for path in args.profiles}
    print("| profiles | common calls | median | 90th pct | median without tiny |\n"
          "|---|---|---|---|---|")
    for a, b in itertools.combinations(args.profiles, 2):
        common = sorted(set(times[a]) & set(times[b]))
        if len(common) < 2:
            print(f"| {a.name} vs {b.name} | {len(common)} | - | - | - |")
            continue
        diffs = [abs(times[a][k] / times[b][k] - 1) for k in common]
        large = [abs(times[a][k] / times[b][k] - 1) for k in common if "tiny" not in k[0]]
        p90 = statistics.quantiles(diffs, n=10)[-1]
        without = f"{statistics.median(large):.1%}" if large else "-"
        print(f"| {a.name} vs {b.name} | {len(common)} | {statistics.median(diffs):.1%} | "
              f"{p90:.1%} | {without} |")


if __name__ == "__main__":
    script_main(main)
