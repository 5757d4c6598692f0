"""Where exits pay: throughput at fixed depth against exit rules with many requests in flight,
on vLLM through the plugin (its exit mode: the tokens still iterating share each block call,
whatever depth each request is at) and in wfd's batch path, on the shipped tiny models.

    python bench/depth_batching.py [--models huginn-tiny ouro-tiny] [--batches 1 8 16 32]
        [--new-tokens 128] [--repeats 3] [--schedule ar|wfd|dtv --draft-depth D] [--out F.json]
        [--profile P.json [--fit-engine [RULE] | --engine-time F.json]]

Each batch B sends B held-out prompts of 64 bytes together (batch 1: four, one at a time), each
for --new-tokens greedy tokens. vLLM runs two engines a repeat, alternating: its own forward at
fixed depth (vLLM's AR, what a user runs today), and one started with ``exit_rule`` "none"
(exits per request) in which each request sets the rule of the row (``extra_args``), or "none"
(the same engine at fixed depth: with the plugin's WFD or DtV, what the exit mode's own
machinery costs; with AR, vLLM's own forward, which takes a step whose requests have no rule
and no wave). Its rows carry
``model``, ``rule``, ``batch``, ``fixed_tokens_per_s`` (vLLM's AR), ``exit_tokens_per_s``,
``wave_fixed_tokens_per_s``, ``mean_exit_depth`` (from the engine's counters), the relative
``bits_per_byte_change`` of the rule (held-out text, teacher forced through wfd's decoder), and
wfd's batch path at the same batch (``wfd_fixed_tokens_per_s``, ``wfd_exit_tokens_per_s``);
medians over the repeats. With ``--schedule wfd`` (or dtv) both sides run it: vLLM the
plugin's WFD without and with the rule, wfd its own. With ``--profile`` (calibrated on this
machine) a row adds ``predicted_speedup``: ``costmodel predict --engine vllm --batch B`` of the
schedule with the run's exit depths (wfd's AR with the rule, on the batch's prompts) over the
same at fixed depth (and ``predicted_exit_tokens_per_s``); with ``--engine-time F.json``
(``bench/vllm_predicted.py --out``'s: the engine's own time per step, sequence, tick and wave,
fitted from the plugin's WFD in the same hour) both sides pay it, the exit mode its waves' ticks
too; with ``--fit-engine`` (AR) that time is fitted from this run instead, at its two smallest
batches: per step and sequence from vLLM's forward at fixed depth, per tick and wave from the
exit mode with each rule (its checks are its own: a rule's time is its own), or with
``--fit-engine RULE`` from that rule for every rule; the rows fitted are marked ``fitted``, and
every other row is predicted; each row's ``engine`` is the time it was predicted with
(``costmodel predict``'s ``--step-overhead --sequence-overhead --tick-overhead --wave-overhead``
for other batches). Exits non-zero
when a vLLM run's greedy tokens are not wfd's AR's with the same rule. Run it on a quiet
machine: the engines use both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from costmodel.engines import EngineOverheads, for_engine
from costmodel.exits import ExitRule, depth_distribution
from costmodel.predict import ScheduleResult, predict
from costmodel.presets import get_model
from costmodel.profile import load_profile
from costmodel.workload import Workload
from wfd.batch import Request, decode_batch
from wfd.checkpoint import load_model
from wfd.generate import generate
from wfd.heldout import held_out_bits
from wfd.serving.offline import run_apart

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_fit import engine_text  # noqa: E402
from tiny_models import heldout_prompts, model_heldout  # noqa: E402
from vllm_predicted import engine_lines  # noqa: E402

from costmodel.clitools import script_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RULES = {"huginn-tiny": ["kl:0.001", "kl:0.01", "argmax-stable:2"],
         "ouro-tiny": ["gate:0.9", "gate:0.8", "kl:0.01"]}


def requests_of(prompts: list[list[int]], batch: int) -> list[list[int]]:
    return prompts[:max(batch, 4)]


def vllm_pass(folder: Path, prompts, batches, new_tokens, rules, plan: dict) -> dict:
    """One repeat on vLLM: {(rule or "fixed" or "none", batch): (tokens/s, tokens, mean exit
    depth)} from two engines, fixed depth first (``plan``: the plugin's schedule options; none:
    AR, at fixed depth vLLM's own forward)."""
    out = {}
    for exits in (False, True):
        modes = ["none", *rules] if exits else ["fixed"]
        runs = [{"prompts": requests_of(prompts, b), "max_tokens": new_tokens, "batch": b,
                 **({"exit": mode} if exits else {})} for mode in modes for b in batches]
        warm_up = {**runs[0], "max_tokens": 8}  # the engine's first steps, not timed
        done = run_apart({"model": str(folder), "runs": [warm_up, *runs], "in_process": True,
                          "overrides": {**plan, "exit_rule": "none"} if exits else plan or None},
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})["runs"]
        warm = done.pop(0).get("wave", {})  # the wave's counters run over the engine's life
        before = (warm.get("decoded_tokens", 0), warm.get("decoded_depths", 0))
        for run, result in zip(runs, done, strict=True):
            wave = result.get("wave", {})
            now = (wave.get("decoded_tokens", 0), wave.get("decoded_depths", 0))
            depth = (now[1] - before[1]) / max(now[0] - before[0], 1) if exits else None
            before = now
            tokens = len(run["prompts"]) * new_tokens
            out[run.get("exit", "fixed"), run["batch"]] = (tokens / result["seconds"],
                                                          result["tokens"], depth)
    return out


def wfd_pass(model, prompts, batches, new_tokens, rules, plan: dict) -> dict:
    """One repeat of wfd's batch path: {(rule or "fixed", batch): tokens/s}."""
    out = {}
    for rule in ["fixed", *rules]:
        for b in batches:
            asked = requests_of(prompts, b)
            started = time.perf_counter()
            decode_batch(model, [Request(i, p, new_tokens) for i, p in enumerate(asked)],
                         schedule=plan.get("schedule", "ar"),
                         draft_depth=plan.get("draft_depth"), batch_size=b,
                         exit_rule=None if rule == "fixed" else ExitRule.parse(rule))
            out[rule, b] = len(asked) * new_tokens / (time.perf_counter() - started)
    return out


def check_tokens(model, name: str, prompts, new_tokens: int, rules, vllm: dict, batch: int
                 ) -> dict[str, list[int]]:
    """vLLM's greedy tokens at ``batch`` are wfd's AR's with the same rule (or none); each
    rule's exit depths in wfd's runs."""
    depths = {}
    for mode in ["fixed", "none", *rules]:
        rule = None if mode in ("fixed", "none") else ExitRule.parse(mode)
        runs = [generate(model, p, max_new_tokens=new_tokens, schedule="ar", exit_rule=rule,
                         record=False) for p in requests_of(prompts, batch)]
        if vllm[mode, batch][1] != [r.tokens for r in runs]:
            sys.exit(f"error: vLLM's greedy tokens with {mode} differ from wfd's AR's on {name}")
        depths[mode] = [d for r in runs for d in r.stats.get("exit_depths", [])]
    return depths


def predicted(profile, name: str, batch: int, new_tokens: int, plan: dict,
              exits: tuple[str, list[int]] | None = None,
              engine: EngineOverheads | None = None, context: int = 64) -> ScheduleResult:
    """``costmodel predict --engine vllm``'s result for the schedule at this batch, with the
    exit depths a rule gave (``exits``: (rule, depths)) or at fixed depth (``plan``'s
    recurrence_depth: R; ``engine``: the engine's own time)."""
    spec, schedule = get_model(name), plan.get("schedule", "ar")
    fields = {}
    if exits is not None:
        rule, depths = exits
        fields["exit_depths"] = depth_distribution(depths)
        if not rule.startswith("forced"):
            fields["exit_rule"] = rule.split(":")[0]
    workload = Workload(context_length=context, new_tokens=new_tokens, batch_size=batch,
                        dtype=profile.dtype, depth=plan.get("recurrence_depth"), **fields)
    return predict(spec, for_engine("vllm", profile.hardware, spec), workload,
                   draft_depth=plan.get("draft_depth"), engine=engine, continuous_depth=True,
                   only=[schedule]).schedules[schedule]


def predicted_pair(profile, name: str, batch: int, new_tokens: int, plan: dict,
                   exits: tuple[str, list[int]], engine: EngineOverheads | None = None,
                   context: int = 64) -> tuple[ScheduleResult, ScheduleResult]:
    """``predicted`` at fixed depth and with the exits, beside each other."""
    return (predicted(profile, name, batch, new_tokens, plan, None, engine, context),
            predicted(profile, name, batch, new_tokens, plan, exits, engine, context))


def fitted_engine(profile, name: str, rule: str, depths: list[int], measured: dict,
                  batches: list[int], new_tokens: int, plan: dict) -> EngineOverheads:
    """The engine's own time from this run's two smallest batches (``--fit-engine``): per step
    and per sequence from vLLM's forward at fixed depth, per tick and per wave in a tick from the
    exit mode with ``rule`` (``measured``: {(mode, batch): tokens/s})."""
    two = sorted(set(batches))[:2]
    bare = {b: predicted(profile, name, b, new_tokens, plan) for b in two}
    waved = {b: predicted(profile, name, b, new_tokens, plan, (rule, depths)) for b in two}
    depth = plan.get("recurrence_depth") or get_model(name).default_depth
    return engine_lines({b: (measured["fixed", b], bare[b].tokens_per_s) for b in two},
                        {b: (measured[rule, b], waved[b].tokens_per_s) for b in two},
                        {b: waved[b].block_calls_per_token for b in two}, depth,
                        EngineOverheads().commit_ahead)


def engine_from_file(path: Path | None) -> EngineOverheads | None:
    """The engine's own time in ``--engine-time``'s file (``bench/vllm_predicted.py --out``)."""
    return None if path is None else EngineOverheads(**json.loads(path.read_text())["engine"])


def model_rows(name: str, args) -> list[dict]:
    model = load_model(name)
    data = model_heldout(name)
    prompts = heldout_prompts(data, max(max(args.batches), 4), length=64)
    rules = args.rules or RULES[name]
    folder = ROOT / "wfd" / "models" / name
    plan = {} if args.schedule == "ar" else {"schedule": args.schedule,
                                              "draft_depth": args.draft_depth}
    vllm, ours = [], []
    for i in range(args.repeats):
        print(f"{name}: pass {i + 1} of {args.repeats}", file=sys.stderr)
        vllm.append(vllm_pass(folder, prompts, args.batches, args.new_tokens, rules, plan))
        ours.append(wfd_pass(model, prompts, args.batches, args.new_tokens, rules, plan))
    depths = check_tokens(model, name, prompts, args.new_tokens, rules, vllm[0],
                          min(args.batches))
    fixed_bits = held_out_bits(model, data, None, windows=args.windows)["bits_per_byte"]

    def median(passes, key, at=0):  # at: tokens/s (0), mean exit depth (2); None: a figure
        return statistics.median(p[key][at] if at is not None else p[key] for p in passes)

    family = name.split("-")[0]
    profile = next((prof for file, prof in args.profiles.items() if family in file), None)
    measured = {key: median(vllm, key) for key in vllm[0]}
    engines = dict.fromkeys(rules, args.engine)
    fit_on = sorted(set(args.batches))[:2] if profile and args.fit_engine else []
    for rule in rules if fit_on else ():
        # the exit mode's own time depends on its rule (its checks): each rule's, or one's
        own = rule if args.fit_engine == "each" else args.fit_engine
        engines[rule] = fitted_engine(profile, name, own, depths[own], measured, args.batches,
                                      args.new_tokens, plan)
        print(f"{name}, {rule} (fitted on {own}): {engine_text(engines[rule])}",
              file=sys.stderr)
    rows = []
    for rule in rules:
        bits = held_out_bits(model, data, ExitRule.parse(rule), windows=args.windows)
        for b in args.batches:
            row = {
                "model": name, "rule": rule, "batch": b,
                "fixed_tokens_per_s": measured["fixed", b],
                "exit_tokens_per_s": measured[rule, b],
                "wave_fixed_tokens_per_s": measured["none", b],
                "mean_exit_depth": median(vllm, (rule, b), 2),
                "bits_per_byte_change": bits["bits_per_byte"] / fixed_bits - 1,
                "wfd_fixed_tokens_per_s": median(ours, ("fixed", b), None),
                "wfd_exit_tokens_per_s": median(ours, (rule, b), None),
                "fixed_passes": [round(p["fixed", b][0], 1) for p in vllm],
                "exit_passes": [round(p[rule, b][0], 1) for p in vllm],
                "schedule": args.schedule}
            if profile:
                fixed, exits = predicted_pair(profile, name, b, args.new_tokens, plan,
                                              (rule, depths[rule]), engines[rule])
                row.update(predicted_speedup=exits.tokens_per_s / fixed.tokens_per_s,
                           predicted_exit_tokens_per_s=exits.tokens_per_s,
                           fitted=b in fit_on and args.fit_engine in ("each", rule),
                           **({"engine": engines[rule].model_dump(mode="json")}
                              if engines[rule] else {}))
            rows.append(row)
    return rows


def check_fit(args) -> None:
    """``--fit-engine`` refused before the run where it cannot be done, in one line (exit 2)."""
    if not args.fit_engine:
        return
    if not args.profile or args.engine_time:
        raise ValueError("--fit-engine goes with --profile, in place of --engine-time")
    if args.schedule != "ar":  # the step's time is fitted from vLLM's forward at fixed depth
        raise ValueError("--fit-engine fits the exit mode of AR: leave out --schedule")
    if len(set(args.batches)) < 2:
        raise ValueError("--fit-engine fits on the two smallest of --batches: give two or more")
    for name in args.models:
        rules = args.rules or RULES.get(name, [])
        if args.fit_engine != "each" and args.fit_engine not in rules:
            raise ValueError(f"--fit-engine {args.fit_engine}: not one of {name}'s rules "
                             f"({', '.join(rules)})")


def table(rows: list[dict]) -> str:
    name = rows[0]["schedule"].upper() if rows else "AR"
    lines = [f"| model | rule | batch | mean exit depth | bits/byte | vLLM {name} tok/s | vLLM "
             f"exit tok/s | x | predicted | exit mode at R tok/s | wfd {name} tok/s | wfd exit "
             "tok/s | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
        predicted += " (fitted)" if r.get("fitted") else ""
        lines.append(
            f"| {r['model']} | `{r['rule']}` | {r['batch']} | {r['mean_exit_depth']:.2f} | "
            f"{r['bits_per_byte_change']:+.2%} | {r['fixed_tokens_per_s']:.0f} | "
            f"{r['exit_tokens_per_s']:.0f} | "
            f"{r['exit_tokens_per_s'] / r['fixed_tokens_per_s']:.2f}x | {predicted} | "
            f"{r['wave_fixed_tokens_per_s']:.0f} | {r['wfd_fixed_tokens_per_s']:.0f} | "
            f"{r['wfd_exit_tokens_per_s']:.0f} | "
            f"{r['wfd_exit_tokens_per_s'] / r['wfd_fixed_tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(RULES))
    parser.add_argument("--rules", nargs="+", help="exit rules (default: each model's three)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--schedule", choices=["ar", "wfd", "dtv"], default="ar",
                        help="the schedule on both sides (wfd, dtv: the plugin's own on vLLM, "
                             "without and with the rule)")
    parser.add_argument("--draft-depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=8,
                        help="held-out windows of 256 bytes for bits per byte")
    parser.add_argument("--profile", type=Path, nargs="+", default=[],
                        help="profiles calibrated on this machine, one per family (its name in "
                             "the file's): adds predicted speedups")
    parser.add_argument("--engine-time", type=Path,
                        help="bench/vllm_predicted.py --out's file: the engine's own time in the "
                             "predictions")
    parser.add_argument("--fit-engine", nargs="?", const="each", metavar="RULE",
                        help="fit the engine's own time from this run's two smallest batches "
                             "(vLLM at fixed depth, the exit mode with each rule, or with RULE "
                             "for every rule) and predict every other row with it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_fit(args)
    # read once, before the run: a bad file is refused at once
    args.profiles = {path.name: load_profile(path) for path in args.profile}
    args.engine = engine_from_file(args.engine_time)
    rows = [row for name in args.models for row in model_rows(name, args)]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    script_main(main)
