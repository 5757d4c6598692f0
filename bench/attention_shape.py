"""What a call's attention shape costs, from a profile's stored block calls (no measuring).

    python bench/attention_shape.py costmodel/data/profiles/gpu-huginn-bf16.json [...]

Each block call the profile measured (training and held-out) reads its keys in one of three
shapes: one position over one key set (an AR step), several positions over one key set (a DtV
verification) or one key set per position (a WFD wave). Prints, per model, the median measured
time of each shape and the median of predicted / measured - 1 under the profile's fit: a fit
without the attention's shape terms prices the three alike, and its errors split by shape.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from calibrate.validate import predict_point
from costmodel.clitools import script_main
from costmodel.profile import ValidationPoint, load_profile

SHAPES = ("one position, one key set", "positions share one key set", "a key set per position")


def shape(point: ValidationPoint) -> str:
    n, key_sets = len(point.record.positions), len(point.record.slot_contexts())
    if key_sets == 1:
        return SHAPES[0] if n == 1 else SHAPES[1]
    return SHAPES[2] if key_sets == n else "mixed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path)
    args = parser.parse_args()
    print("| profile | model | shape | calls | median ms | median predicted / measured - 1 |\n"
          "|---|---|---|---|---|---|")
    for path in args.profiles:
        profile = load_profile(path)
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for point in profile.training + profile.validation:
            if point.kind == "call" and point.group == "block":
                error = predict_point(point, profile.hardware, profile.dtype) / point.measured_s
                groups.setdefault((point.model, shape(point)), []).append(
                    (point.measured_s, error - 1))
        for (model, kind), rows in sorted(groups.items(), key=lambda g: (
                g[0][0], SHAPES.index(g[0][1]) if g[0][1] in SHAPES else 3)):
            print(f"| {path.name} | {model} | {kind} | {len(rows)} | "
                  f"{statistics.median(t for t, _ in rows) * 1e3:.2f} | "
                  f"{statistics.median(e for _, e in rows):+.1%} |")


if __name__ == "__main__":
    script_main(main)
