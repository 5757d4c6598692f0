"""How far the event simulator's mean lands from the closed forms, over random configurations
drawn as tests/test_schedules.py draws them (WFD with and without a cap, DtV; acceptance in
[0, 1]; KV sharing 0, 1 or 4; Huginn-3.5B or Ouro-2.6B on an A6000; three 800-token runs each).

    python bench/simulator_vs_closed_form.py [--configs 150] [--seed 1]

Prints the largest, 99th-percentile and median relative differences of the per-token latency and
of the block calls per token: what the test's tolerance is set against.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from costmodel import WFD, DtV, get_hardware, get_model, simulate
from costmodel.clitools import script_main
from costmodel.groups import block_calls_per_token
from costmodel.predict import _Pricer

A6000 = get_hardware("a6000")


def closed_form(model, schedule, alpha: float, context: int, new_tokens: int, sharing: int):
    pricer = _Pricer(model, A6000, "bf16", np.asarray(context + (new_tokens - 2) / 2),
                     np.asarray(1.0), None)
    groups = schedule.call_groups(model.default_depth, sharing)
    return (float(pricer.per_token(groups, np.asarray(alpha))["latency_s"]),
            float(block_calls_per_token(groups, np.asarray(alpha))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    latency_errors, call_errors = [], []
    for _ in range(args.configs):
        seed = rng.randint(0, 2**16)
        model = get_model("ouro-2.6b") if seed % 2 else get_model("huginn-3.5b")
        d = min(rng.randint(1, 31), model.default_depth - 1)
        kind = rng.choice(["wfd", "capped", "dtv"])
        schedule = {"wfd": WFD(draft_depth=d),
                    "capped": WFD(draft_depth=d, width_cap=rng.randint(1, 12)),
                    "dtv": DtV(block_length=rng.randint(1, 8), draft_depth=d)}[kind]
        alpha, sharing = rng.random(), rng.choice([0, 1, 4])
        sims = [simulate(model, A6000, schedule, context_length=2048, new_tokens=800,
                         acceptance=alpha, seed=seed + i, kv_sharing=sharing, records=False)
                for i in range(3)]
        latency, calls = closed_form(model, schedule, alpha, 2048, 800, sharing)
        latency_errors.append(abs(np.mean([s.latency_per_token_s for s in sims]) / latency - 1))
        call_errors.append(abs(np.mean([s.block_calls / s.committed_tokens for s in sims])
                               / calls - 1))
    for name, errors in (("latency per token", latency_errors),
                         ("block calls per token", call_errors)):
        print(f"{name}: max {max(errors):.2%}, 99th percentile "
              f"{np.percentile(errors, 99):.2%}, median {np.median(errors):.2%} "
              f"({len(errors)} configurations)")


if __name__ == "__main__":
    script_main(main)
