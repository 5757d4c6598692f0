"""The cost model beside vLLM: `costmodel predict --engine vllm` for vLLM's AR and the plugin's
DtV and WFD, against what bench/vllm_peer.py measured on the machine a profile came from.

    python bench/vllm_predicted.py --peer PEER.json --profile PROFILE.json
        [--profile ouro-tiny=OURO.json] [--fit huginn-tiny] [--out FILE.json]

The per-call costs come from the profile (a calibration of `wfd`'s decoder on this machine; a
model's own with MODEL=FILE, e.g. `costmodel calibrate --model ouro --quick`'s for ouro-tiny);
what a calibration does not hold is the engine's own time. Three figures of one model (--fit)
give it: vLLM's AR at batch 1 and 8 (its time per step, and per sequence in a step: measured
less predicted per token, two equations) and the plugin's WFD at batch 1 and 8 (its time per
tick, and per wave in a tick: the rest over the block calls per token, two more). Every other
row is then a prediction (`predict --step-overhead --sequence-overhead --tick-overhead
--wave-overhead --commit-ahead`, with the acceptance the waves measured): the other model's
six, and the fitted model's DtV. Tokens/s as the peer bench counts them: a run of its prompts,
prefills included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from costmodel.clitools import script_main
from costmodel.engines import EngineOverheads, for_engine
from costmodel.predict import ScheduleResult, predict
from costmodel.presets import get_model
from costmodel.profile import load_profile
from costmodel.workload import Workload

MEASURED = {"ar": "vllm_ar_in_process_tokens_per_s", "dtv": "vllm_plugin_dtv_tokens_per_s",
            "wfd": "vllm_wfd_tokens_per_s"}
ACCEPTANCE = {"dtv": "vllm_plugin_dtv_acceptance", "wfd": "vllm_wfd_acceptance"}


def predicted(peer: dict, row: dict, hardware: dict, engine: EngineOverheads | None
              ) -> dict[str, ScheduleResult]:
    """Each schedule's prediction for one row of the peer bench (its model and batch), on the
    model's profile's hardware (``hardware[None]``: every other model's)."""
    spec = get_model(row["model"])
    hw = hardware.get(row["model"], hardware[None])
    out = {}
    for schedule in MEASURED:
        workload = Workload(context_length=round(peer["prompt_tokens_mean"]),
                            new_tokens=peer["new_tokens"], batch_size=row["batch"],
                            prompts=peer["prompts"], dtype="fp32",
                            acceptance=row.get(ACCEPTANCE.get(schedule, ""), None))
        result = predict(spec, for_engine("vllm", hw, spec), workload,
                         block_length=peer["block_length"], engine=engine)
        out[schedule] = result.schedules[schedule]
    return out


def two_point_line(extra: dict[int, float]) -> tuple[float, float]:
    """(a, b) of a + B * b through the figures at two batches B (neither below zero)."""
    low, high = sorted(extra)
    per = max(0.0, (extra[high] - extra[low]) / (high - low))
    return max(0.0, extra[low] - low * per), per


def engine_lines(steps: dict[int, tuple[float, float]], waves: dict[int, tuple[float, float]],
                 ticks: dict[int, float], depth: int, commit_ahead: int) -> EngineOverheads:
    """The engine's own time from tokens/s at two batches B, each (measured, predicted without
    the engine): vLLM's AR's (``steps``) give its time per step and per sequence in a step (a
    step of B sequences takes step + B * sequence more than its calls); the waves' (``waves``,
    ``ticks`` per token by batch) the rest of their steps over their ticks, per tick and per wave
    in a tick."""
    step_s, sequence_s = two_point_line({b: b / m - b / p for b, (m, p) in steps.items()})
    engine = EngineOverheads(step_s=step_s, per_sequence_s=sequence_s, commit_ahead=commit_ahead)
    tick_s, wave_s = two_point_line({
        b: (b / m - b / p - b * engine.per_token_s(b, True, ticks[b], depth)) / ticks[b]
        for b, (m, p) in waves.items()})
    return engine.model_copy(update={"tick_s": tick_s, "wave_tick_s": wave_s})


def fit(peer: dict, hw: dict, model: str) -> EngineOverheads:
    """The engine's times from ``model``'s AR and WFD at batch 1 and 8."""
    rows = {row["batch"]: row for row in peer["rows"] if row["model"] == model}
    bare = {b: predicted(peer, rows[b], hw, None) for b in (1, 8)}
    return engine_lines(
        {b: (rows[b][MEASURED["ar"]], bare[b]["ar"].tokens_per_s) for b in (1, 8)},
        {b: (rows[b][MEASURED["wfd"]], bare[b]["wfd"].tokens_per_s) for b in (1, 8)},
        {b: rows[b]["vllm_wfd_block_calls_per_token"] for b in (1, 8)},
        get_model(model).default_depth, peer.get("commit_ahead", 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, required=True)
    parser.add_argument("--profile", action="append", required=True,
                        help="PATH, or MODEL=PATH for that model's rows")
    parser.add_argument("--fit", default="huginn-tiny")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    peer = json.loads(args.peer.read_text())
    hw = {None: None}
    for given in args.profile:
        model, _, path = given.rpartition("=")
        hw[model or None] = load_profile(Path(path)).hardware
    if hw[None] is None:
        sys.exit("error: give one --profile PATH for the models without one of their own")
    engine = fit(peer, hw, args.fit)
    print(f"the engine's own time (fitted on {args.fit}): {engine.step_s * 1e3:.2f} ms a step, "
          f"{engine.per_sequence_s * 1e3:.2f} ms a sequence in it; {engine.tick_s * 1e3:.3f} ms a "
          f"tick, {engine.wave_tick_s * 1e3:.3f} ms a wave in it; {engine.commit_ahead} tokens "
          "committed ahead")
    print("| model | batch | schedule | measured tokens/s | predicted | error | |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for row in peer["rows"]:
        guesses = predicted(peer, row, hw, engine)
        for schedule, key in MEASURED.items():
            fitted = row["model"] == args.fit and schedule in ("ar", "wfd")
            measured, guess = row[key], guesses[schedule].tokens_per_s
            rows.append({"model": row["model"], "batch": row["batch"], "schedule": schedule,
                         "measured_tokens_per_s": measured, "predicted_tokens_per_s": guess,
                         "fitted": fitted})
            print(f"| {row['model']} | {row['batch']} | {schedule} | {measured:.1f} | "
                  f"{guess:.1f} | {guess / measured - 1:+.0%} | {'fitted' if fitted else ''} |")
    if args.out:
        args.out.write_text(json.dumps({"engine": engine.model_dump(), "rows": rows}, indent=1))


if __name__ == "__main__":
    script_main(main)
