"""Refit a profile's cost model on a chosen subset of positions per call, from the calls the
profile holds out, and see how well each subset predicts the rest: which positions a CPU's
calibration must see.

    python bench/refit_positions.py PROFILE 1,2,4,32 [1,2,4,8,32 ...]

The profile's held-out calls of its fitted models (the middle context) at the given positions
train a fit of the same coefficients `costmodel calibrate` fits (from the profile's measured
peaks, kernel counts and blocked-product switch); the error is then measured on those models'
calls at the other positions and on every call of the held-out size. Prints a Markdown table of
median |predicted / measured - 1|.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from calibrate.fit import Observation, fit, predict_calls
from costmodel.profile import load_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("subsets", nargs="+", help="comma-separated positions per call")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    held_out = profile.models[-1]
    calls = [p for p in profile.validation if p.kind == "call"]
    fitted = [Observation(p.spec, p.record, p.measured_s) for p in calls if p.model != held_out]
    unseen = [Observation(p.spec, p.record, p.measured_s) for p in calls if p.model == held_out]

    def median_error(hardware, observations: list[Observation]) -> float:
        predicted = predict_calls(hardware, observations, profile.dtype)
        return statistics.median(abs(t / o.seconds - 1)
                                 for t, o in zip(predicted, observations, strict=True))

    print(f"{args.profile.name}: {len(fitted)} calls of the fitted models, {len(unseen)} of "
          f"{held_out}\n")
    print("| trained on positions | other positions | held-out size | both |\n|---|---|---|---|")
    for subset in args.subsets:
        positions = {int(n) for n in subset.split(",")}
        train = [o for o in fitted if len(o.record.positions) in positions]
        rest = [o for o in fitted if len(o.record.positions) not in positions]
        if len(train) < 10 or not rest:
            print(f"| {subset} | (too few calls to train on or to test) | | |")
            continue
        hardware = fit(profile.hardware, train, profile.dtype).hardware
        errors = [median_error(hardware, o) for o in (rest, unseen, rest + unseen)]
        print(f"| {subset} | " + " | ".join(f"{e:.1%}" for e in errors) + " |")


if __name__ == "__main__":
    main()
