"""Are a run's calls slower than the same calls timed alone? The calibration times each call shape
alone (repeated, the median, the faster of two passes) and validates on whole runs; when a run
comes out slower than its calls predict, this tells whether the run itself is slower (the
decoder's loop, caches, threads) or only measured at a worse moment.

    python bench/run_vs_calls.py [--model ouro-base:random] [--tokens 48] [--rounds 3]
        [--schedule ar|dtv] [--profile FILE]

Each round decodes a run (prompt of 64; DtV with draft depth 1 and blocks of 4, acceptance forced
to 0.85), then times alone, the way `costmodel calibrate` does, the run's widest block call (AR:
one position; DtV: the verification, 5 positions at one depth) at the run's middle context.
Prints per round: the run's decode time per token, the median of those calls inside it, the call
timed alone, and their ratio; with ``--profile``, also the call as the profile's cost model prices
it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from calibrate.measure import Grid, measure_runs, time_call
from calibrate.run import spec_for
from costmodel.profile import ProfileError, load_profile
from costmodel.simulate import price_records
from wfd.checkpoint import load_model

PROMPT = [32 + (i * 7) % 90 for i in range(64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ouro-base:random")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", choices=["ar", "dtv"], default="ar")
    parser.add_argument("--profile", type=Path, help="a calibration profile to price the call")
    args = parser.parse_args()
    profile = None
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except ProfileError as exc:
            raise SystemExit(str(exc)) from None
    kwargs = {"draft_depth": 1, "block_length": 4} if args.schedule == "dtv" else {}
    model = load_model(args.model, device="cpu", dtype="fp32")
    context = len(PROMPT) + args.tokens // 2
    grid = Grid(positions=[1], contexts=[context], repeats=7, warmup=2)
    priced = " predicted |" if profile else ""
    print("| round | run: ms per token | positions | block call in the run (median) | "
          f"block call alone | ratio |{priced}\n|---|---|---|---|---|---|"
          + ("---|" if profile else ""))
    for round_index in range(1, args.rounds + 1):
        run = measure_runs(args.model, model, PROMPT, args.tokens, [(args.schedule, kwargs)],
                           forced=0.85 if args.schedule == "dtv" else None)[0]
        prefill_s = sum(r.wall_s for r in run.records if min(r.positions) < len(PROMPT))
        per_token_s = (run.wall_s - prefill_s) / (run.tokens - 1)
        decode = [r for r in run.records if r.kind == "block" and min(r.positions) >= len(PROMPT)]
        widest = max(len(r.positions) for r in decode)
        in_run_s = statistics.median(r.wall_s for r in decode if len(r.positions) == widest)
        alone = time_call(model, args.model, "block", widest, context, 1, grid)
        alone_s = alone.median_s
        predicted = ""
        if profile:
            record = alone.record.model_copy()
            price_records(spec_for(args.model, model), profile.hardware, [record],
                          dtype=profile.dtype)
            predicted = f" {record.wall_s * 1e3:.2f} ms ({record.wall_s / alone_s - 1:+.1%}) |"
        print(f"| {round_index} | {per_token_s * 1e3:.1f} | {widest} | {in_run_s * 1e3:.2f} ms | "
              f"{alone_s * 1e3:.2f} ms | {in_run_s / alone_s:.3f} |{predicted}")


if __name__ == "__main__":
    main()
