"""Refit a profile's cost model on another choice of positions per call, without measuring again:
which positions a CPU's calibration must see.

    python bench/refit_positions.py PROFILE 1,2,3,4,32 [1,2,4,32 ...] [--fix NAME ...]

A profile keeps every call it measured (the fit's training calls and the held-out ones). For each
comma-separated subset, the calls are split as `costmodel calibrate` splits them, with the subset
in place of its training positions: the fitted models' calls at those positions and at the
shortest and longest context train the fit of the calibration's coefficients (from the profile's
measured peaks, kernel counts and matrix-product curve), taking out those the calls do not
determine as the calibration does; every other call, and every call of the held-out size, is
predicted. Prints a Markdown table of median and max |predicted / measured - 1| over the
held-out calls and over the profile's whole runs. With ``--fix NAME``, that coefficient is not
fitted but held at the hardware spec's default (for ``attention_flops_efficiency`` the flops
efficiency; for ``matmul_time_scale`` 1): what the coefficient adds.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from calibrate.fit import PARAMETERS, Observation, fit, parameters_for
from calibrate.validate import predict_point
from costmodel.clitools import script_main
from costmodel.hardware import HardwareSpec
from costmodel.profile import ValidationPoint, load_profile


def split(calls: list[ValidationPoint], positions: set[int], held_out: str
          ) -> tuple[list[ValidationPoint], list[ValidationPoint]]:
    """(training calls, held-out calls) as the calibration splits them."""
    contexts: dict[str, set[int]] = {}
    for call in calls:
        contexts.setdefault(call.model, set()).add(min(call.record.positions))

    def trains(call: ValidationPoint) -> bool:
        context = min(call.record.positions)
        ends = (min(contexts[call.model]), max(contexts[call.model]))
        return (call.model != held_out and len(call.record.positions) in positions
                and context in ends)

    return [c for c in calls if trains(c)], [c for c in calls if not trains(c)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("subsets", nargs="+", help="comma-separated positions per call")
    parser.add_argument("--fix", nargs="+", default=[], choices=[p.name for p in PARAMETERS],
                        help="coefficients held at their default instead of fitted")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    if not profile.training:
        raise SystemExit(f"{args.profile} keeps no training calls (made before they were kept); "
                         "calibrate again")
    calls = [p for p in profile.training + profile.validation if p.kind == "call"]
    part = HardwareSpec.PARTS
    start = profile.hardware.with_terms(**{
        name: part[HardwareSpec.PART_OF[name]].model_fields[name].default for name in args.fix})
    # every coefficient this version fits on this kind of device
    free = [p for p in parameters_for(profile.hardware) if p.name not in args.fix]
    runs = [p for p in profile.validation if p.kind == "run"]

    def errors(hardware, points: list[ValidationPoint]) -> list[float]:
        return [abs(predict_point(p, hardware, profile.dtype) / p.measured_s - 1) for p in points]

    print(f"{args.profile.name}: {len(calls)} calls, {len(runs)} runs; held-out size "
          f"{profile.models[-1]}; fixed: {', '.join(args.fix) or 'none'}\n")
    print("| trained on positions | training calls | held-out calls: median / max "
          "| runs: median / max |\n|---|---|---|---|")
    for subset in args.subsets:
        positions = {int(n) for n in subset.split(",")}
        train, held = split(calls, positions, profile.models[-1])
        if len(train) < 10 or not held:
            print(f"| {subset} | {len(train)} | (too few calls to train on or to test) | |")
            continue
        observations = [Observation(c.spec, c.record, c.measured_s) for c in train]
        hardware = fit(start, observations, profile.dtype, free).hardware
        cells = [f"{statistics.median(e):.1%} / {max(e):.1%}"
                 for e in (errors(hardware, held), errors(hardware, runs))]
        print(f"| {subset} | {len(train)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    script_main(main)
