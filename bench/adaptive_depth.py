"""Adaptive depth on the shipped tiny models: what each exit rule saves, what it costs, and how
well the cost model predicts the speedups with exits.

    python bench/adaptive_depth.py [--models huginn-tiny ouro-tiny] [--rules kl:0.01 ...]
        [--prompts 4] [--new-tokens 128] [--repeats 3] [--windows 8] [--exit-kv reference]

For each model and rule (defaults: RULES below), on held-out text and prompts (greedy, fp32):

- bits per byte of AR with the rule (teacher forced through the decoder, exits and their KV rule
  included) against fixed depth R, the mean exit depth, and how often AR-with-exit's greedy
  tokens equal fixed-depth AR's on the prompts;
- tokens/s of AR and WFD, fixed depth and with the rule, and of DtV (k = 4) with the rule
  (medians over repeats of whole prompt sets), block calls per token, and WFD's speedup over
  AR-with-exit against the tick bound at the measured exit depths and acceptance: AR's block
  calls per token (the mean exit depth) over a wave's expected ticks per token,
  a * E[min(d, e)] + (1 - a) * E[e] (a: the share of positions whose draft is their token);
- the speedups of WFD and DtV over AR-with-exit that `costmodel predict --depth-trace
  --exit RULE` gives from depth traces recorded on the same prompts, with a profile rescaled to
  this machine from the model's calls timed now (wfd.transplant), against the measured;
- adaptive drafting (``--drafts``): WFD's tokens/s at every fixed draft depth, against WFD
  drafting where a looser rule fires (DRAFT_RULES, bounded by DRAFT_BOUND), at fixed depth R.

Timed runs interleave the configurations pass by pass (the VM's noise drifts over minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from costmodel.exits import ExitRule
from costmodel.predict import predict
from costmodel.trace import TraceHeader, write_jsonl
from costmodel.workload import Workload
from wfd.checkpoint import load_model
from wfd.generate import generate
from wfd.heldout import held_out_bits

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import heldout_prompts, model_heldout  # noqa: E402

from costmodel.clitools import script_main

RULES = {"huginn-tiny": ["kl:0.01", "kl:0.001", "kl:0.0001", "entropy-diff:0.01",
                         "latent-diff:0.03", "argmax-stable:2"],
         "ouro-tiny": ["gate:0.8", "gate:0.9", "gate:0.95", "kl:0.01"]}
BLOCK_LENGTH = 4
DRAFT_RULES = {"huginn-tiny": ["argmax-stable:1", "kl:0.1", "kl:0.02"],
               "ouro-tiny": ["argmax-stable:1", "kl:0.1", "gate:0.5"]}
DRAFT_BOUND = {"huginn-tiny": 4, "ouro-tiny": 3}  # the deepest an adaptive draft goes


def timed(model, prompts, repeats: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Per configuration (generate's options): tokens/s over the prompt set (the median of
    ``repeats`` passes, the configurations interleaved pass by pass), its spread, block calls
    per token, and the last pass's results."""
    rates: dict[str, list[float]] = {name: [] for name in configs}
    results: dict[str, list] = {}
    for _ in range(repeats):
        for name, options in configs.items():
            results[name] = [generate(model, p, record=True, **options) for p in prompts]
            rates[name].append(sum(len(r.tokens) for r in results[name])
                               / sum(r.wall_s for r in results[name]))
    out = {}
    for name, runs in results.items():
        tokens = sum(len(r.tokens) for r in runs)
        out[name] = {"tokens_per_s": statistics.median(rates[name]),
                     "spread": (min(rates[name]), max(rates[name])),
                     "block_calls_per_token": sum(r.block_calls for r in runs) / tokens,
                     "results": runs}
    return out


def tick_bound(ar_exit, wfd_exit, draft_depth: int) -> float:
    depths = [e for r in ar_exit["results"] for e in r.stats["exit_depths"]]
    stats = [r.stats for r in wfd_exit["results"]]
    drafted_final = sum(s["bonus"] for s in stats)  # positions that exited by d
    verified = sum(s["drafts_verified"] for s in stats)
    a = (sum(s["accepted"] for s in stats) + drafted_final) / (verified + drafted_final)
    mean_e = statistics.fmean(depths)
    shallow = statistics.fmean(min(draft_depth, e) for e in depths)
    return mean_e / (a * shallow + (1 - a) * mean_e)


def predicted_speedups(model, name, profile, prompts, new_tokens, rule, draft_depth):
    """WFD's and DtV's speedups over AR-with-exit from depth traces of the prompts."""
    out = {"wfd": [], "dtv": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts):
            run = generate(model, prompt, max_new_tokens=new_tokens, depth_trace=True,
                           record=False)
            path = Path(tmp) / f"{i}.jsonl"
            write_jsonl(path, TraceHeader(trace="depths", source="measured", model=name,
                                          device="cpu", dtype="fp32",
                                          depth=model.config.depth,
                                          prompt_length=len(prompt)), run.depth_records)
            wl = Workload(context_length=len(prompt), new_tokens=new_tokens, dtype="fp32",
                          depth_trace=str(path), exit_rule=f"{rule.name}:{rule.threshold:g}",
                          exit_min_depth=rule.min_depth, exit_kv=rule.kv)
            p = predict(model.config.to_spec(name), profile.hardware, wl,
                        draft_depth=draft_depth, block_length=BLOCK_LENGTH)
            for kind in out:
                out[kind].append(p.schedules[kind].speedup_vs_ar)
    return {kind: statistics.fmean(v) for kind, v in out.items()}


def adaptive_drafts(model, name: str, prompts, repeats: int, common: dict) -> None:
    depth, bound = model.config.depth, DRAFT_BOUND[name]
    configs = {f"d = {d}": dict(schedule="wfd", draft_depth=d, **common)
               for d in range(1, depth)}
    configs.update({f"{rule}, d <= {bound}": dict(
        schedule="wfd", draft_depth=bound, draft_rule=ExitRule.parse(rule), **common)
        for rule in DRAFT_RULES[name]})
    runs = timed(model, prompts, repeats, configs)
    best = max((k for k in runs if k.startswith("d = ")), key=lambda k: runs[k]["tokens_per_s"])
    print(f"adaptive drafting, WFD at fixed depth R (best fixed draft depth: {best})\n")
    print("| drafts | tokens/s (spread) | x best fixed d | acceptance | block calls/token |")
    print("|---|---|---|---|---|")
    for label, run in runs.items():
        stats = [r.stats for r in run["results"]]
        verified = sum(s["drafts_verified"] for s in stats)
        acceptance = sum(s["accepted"] for s in stats) / verified
        print(f"| {label} | {run['tokens_per_s']:.1f} ({run['spread'][0]:.1f}-"
              f"{run['spread'][1]:.1f}) | {run['tokens_per_s'] / runs[best]['tokens_per_s']:.2f}x"
              f" | {acceptance:.3f} | {run['block_calls_per_token']:.2f} |", flush=True)


def exit_row(model, name: str, data: bytes, prompts, profile, rule: ExitRule,
             fixed_bits: float, args, common: dict) -> None:
    """One rule's row: its bits per byte and exit depth, AR, WFD and DtV with it against fixed
    depth (interleaved pass by pass), and the predicted speedups beside the measured."""
    text, d = rule.label, model.config.default_draft_depth
    bits = held_out_bits(model, data, rule, windows=args.windows)
    runs = timed(model, prompts, args.repeats, {
        "fixed ar": common, "fixed wfd": dict(schedule="wfd", **common),
        "ar": dict(exit_rule=rule, **common),
        "wfd": dict(schedule="wfd", exit_rule=rule, **common),
        "dtv": dict(schedule="dtv", exit_rule=rule, block_length=BLOCK_LENGTH,
                    **common)})
    ar_x, wfd_x, dtv_x = runs["ar"], runs["wfd"], runs["dtv"]
    ar, wfd = runs["fixed ar"], runs["fixed wfd"]
    same = [a == b for x, y in zip(ar_x["results"], ar["results"], strict=True)
            for a, b in zip(x.tokens, y.tokens, strict=False)]
    bound = tick_bound(ar_x, wfd_x, d)
    wfd_speedup = wfd_x["tokens_per_s"] / ar_x["tokens_per_s"]
    dtv_speedup = dtv_x["tokens_per_s"] / ar_x["tokens_per_s"]
    predicted = predicted_speedups(model, name, profile, prompts, args.new_tokens,
                                   rule, d)
    print(f"| {text} | {bits['mean_exit_depth']:.2f} | {bits['bits_per_byte']:.4f} "
          f"({bits['bits_per_byte'] / fixed_bits - 1:+.2%}) | {sum(same) / len(same):.1%}"
          f" | {ar_x['tokens_per_s']:.1f} ({ar_x['tokens_per_s'] / ar['tokens_per_s']:.2f}"
          f"x) | {wfd_x['tokens_per_s']:.1f} "
          f"({wfd_x['tokens_per_s'] / wfd['tokens_per_s']:.2f}x) | {wfd_speedup:.2f}x "
          f"({bound:.2f}x, {wfd_speedup / bound:.0%}) | {predicted['wfd']:.2f}x "
          f"({predicted['wfd'] / wfd_speedup - 1:+.0%}) | {dtv_speedup:.2f}x | "
          f"{predicted['dtv']:.2f}x ({predicted['dtv'] / dtv_speedup - 1:+.0%}) |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(RULES))
    parser.add_argument("--rules", nargs="+", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--exit-kv", choices=["latest", "reference"], default="latest",
                        help="the rules' exit KV rule (reference: the public Huginn code's)")
    parser.add_argument("--drafts", action="store_true",
                        help="measure adaptive drafting instead of exits")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from costmodel.store import committed_profiles
    from wfd.runtime import machine_name
    from wfd.transplant import transplant

    for name in args.models:
        model = load_model(name)
        depth, d = model.config.depth, model.config.default_draft_depth
        data = model_heldout(name)
        prompts = heldout_prompts(data, args.prompts, length=64)
        base = next(p for _, p in committed_profiles(model.config.family, "cpu"))
        started = time.perf_counter()
        profile = transplant(base, model, name, machine_name("cpu"))
        print(f"\n## {name} (R = {depth}, d = {d}, {args.prompts} held-out prompts x "
              f"{args.new_tokens} tokens, {args.repeats} passes; {profile.checks[0]}, "
              f"{time.perf_counter() - started:.0f} s)\n")
        common = dict(max_new_tokens=args.new_tokens)
        if args.drafts:
            adaptive_drafts(model, name, prompts, args.repeats, common)
            continue
        fixed_bits = held_out_bits(model, data, None, windows=args.windows)["bits_per_byte"]
        print(f"fixed depth: {fixed_bits:.4f} bits/byte; each row's runs interleave fixed-depth "
              "AR and WFD with the rule's AR, WFD and DtV, pass by pass\n")
        print("| rule | mean exit depth | bits/byte (vs R) | tokens = fixed AR's | AR tokens/s "
              "(x fixed AR) | WFD tokens/s (x fixed WFD) | WFD / AR-exit (tick bound, share) | "
              "predicted WFD / AR-exit | DtV / AR-exit | predicted DtV / AR-exit |")
        print("|---" * 10 + "|")
        for text in args.rules or RULES[name]:
            exit_row(model, name, data, prompts, profile, ExitRule.parse(text, kv=args.exit_kv),
                     fixed_bits, args, common)


if __name__ == "__main__":
    script_main(main)
