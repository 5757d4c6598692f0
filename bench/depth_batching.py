"""Where exits pay: throughput at fixed depth against exit rules with many requests in flight,
on vLLM through the plugin (its exit mode: the tokens still iterating share each block call,
whatever depth each request is at) and in wfd's batch path, on the shipped tiny models.

    python bench/depth_batching.py [--models huginn-tiny ouro-tiny] [--batches 1 8 16 32]
        [--new-tokens 128] [--repeats 3] [--schedule ar|wfd|dtv --draft-depth D] [--out F.json]

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
same at fixed depth; with ``--engine-time F.json`` (``bench/vllm_predicted.py --out``'s: the
engine's own time per step, sequence, tick and wave, fitted in the same hour) both sides pay
it, the exit mode its waves' ticks too. Exits non-zero
when a vLLM run's greedy tokens are not wfd's AR's with the same rule. Run it on a quiet
machine: the engines use both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from costmodel.exits import ExitRule, depth_distribution
from wfd.batch import Request, decode_batch
from wfd.checkpoint import load_model
from wfd.generate import generate
from wfd.heldout import held_out_bits
from wfd.serving.offline import run_apart

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import heldout_prompts, model_heldout  # noqa: E402

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


def predicted_speedup(profile: Path, name: str, rule: str, depths: list[int], batch: int,
                      new_tokens: int, plan: dict, context: int = 64,
                      engine: list[str] = ()) -> float:
    """``costmodel predict --engine vllm``'s tokens/s of the schedule with these exit depths
    over the same at fixed depth, at this batch (``plan``'s recurrence_depth: R; ``engine``:
    more of predict's options, the engine's own time)."""
    schedule = plan.get("schedule", "ar")
    drafts = ["--draft-depth", str(plan["draft_depth"])] if "draft_depth" in plan else []
    if "recurrence_depth" in plan:
        drafts += ["--depth", str(plan["recurrence_depth"])]
    def tokens_per_s(*extra: str) -> float:
        done = subprocess.run(
            ["costmodel", "predict", "--profile", str(profile), "--model", name, "--context",
             str(context), "--new-tokens", str(new_tokens), "--batch", str(batch), "--engine",
             "vllm", "--json", *drafts, *engine, *extra], capture_output=True, text=True,
            check=True)
        return json.loads(done.stdout)["schedules"][schedule]["tokens_per_s"]

    spread = ",".join(f"{r}:{p:.8f}" for r, p in depth_distribution(depths).items())
    named = [] if rule.startswith("forced") else ["--exit", rule.split(":")[0]]
    return tokens_per_s("--exit-depths", spread, *named) / tokens_per_s()


def engine_options(args) -> list[str]:
    """``costmodel predict``'s options for the engine's own time in ``--engine-time``'s file."""
    if args.engine_time is None:
        return []
    engine = json.loads(args.engine_time.read_text())["engine"]
    return ["--step-overhead", f"{engine['step_s']}s", "--sequence-overhead",
            f"{engine['per_sequence_s']}s", "--tick-overhead", f"{engine['tick_s']}s",
            "--wave-overhead", f"{engine['wave_tick_s']}s", "--commit-ahead",
            str(engine["commit_ahead"])]


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

    def median(passes, key, at=0):
        return statistics.median(p[key][at] if at is not None else p[key] for p in passes)

    family = name.split("-")[0]
    profile = next((p for p in args.profile if family in p.name), None)
    rows = []
    for rule in rules:
        bits = held_out_bits(model, data, ExitRule.parse(rule), windows=args.windows)
        for b in args.batches:
            rows.append({
                "model": name, "rule": rule, "batch": b,
                "fixed_tokens_per_s": median(vllm, ("fixed", b)),
                "exit_tokens_per_s": median(vllm, (rule, b)),
                "wave_fixed_tokens_per_s": median(vllm, ("none", b)),
                "mean_exit_depth": median(vllm, (rule, b), 2),
                "bits_per_byte_change": bits["bits_per_byte"] / fixed_bits - 1,
                "wfd_fixed_tokens_per_s": median(ours, ("fixed", b), None),
                "wfd_exit_tokens_per_s": median(ours, (rule, b), None),
                "fixed_passes": [round(p["fixed", b][0], 1) for p in vllm],
                "exit_passes": [round(p[rule, b][0], 1) for p in vllm],
                "schedule": args.schedule,
                **({"predicted_speedup": predicted_speedup(profile, name, rule, depths[rule],
                                                           b, args.new_tokens, plan,
                                                           engine=engine_options(args))}
                   if profile else {})})
    return rows


def table(rows: list[dict]) -> str:
    name = rows[0]["schedule"].upper() if rows else "AR"
    lines = [f"| model | rule | batch | mean exit depth | bits/byte | vLLM {name} tok/s | vLLM "
             f"exit tok/s | x | predicted | exit mode at R tok/s | wfd {name} tok/s | wfd exit "
             "tok/s | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [row for name in args.models for row in model_rows(name, args)]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    script_main(main)
