"""The regret of `costmodel recommend`: measured tokens/s of the configuration it recommends
against the best of a grid of configurations measured on this machine.

    python bench/recommend_regret.py [--new-tokens 128] [--repeats 3] [--random ouro-base:random]
        [--random-tokens 32] [--auto-only] [--transplant] [--out docs/results/FILE.md]

Cases: the shipped huginn-tiny and ouro-tiny decoding for real (the acceptance by depth from a
depth trace of AR runs over the prompts), and a random-weight model with forced acceptance
curves alpha(d) = 1 - (1 - a0) d0 / d at a0 = 0.6, 0.8 and 0.95 (each configuration's runs
forced at its own draft depth's acceptance). The recommendation prices with this machine's
committed profile (costmodel/data/profiles/cpu-FAMILY-fp32.json). Grid: AR; DtV d x k in
{2, 4, 8}; WFD d x (no cap, half the width); plus the recommended configuration. Runs are
interleaved, medians of --repeats. Regret = 1 - measured(recommended) / measured(best). Also times
`--schedule auto` against the configuration it chooses (huginn-tiny, --new-tokens).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from decode_speed import PROMPTS, prompts_for, time_schedule

from costmodel import Workload, recommend
from costmodel.clitools import script_main
from costmodel.profile import load_profile
from costmodel.schedules import wave_width
from costmodel.store import PROFILES_DIR
from costmodel.trace import atomic_write
from studies.recommend import acceptance_curve
from wfd.checkpoint import load_model
from wfd.generate import generate

PROFILES = PROFILES_DIR


def depth_acceptance(model, new_tokens: int) -> dict[int, float]:
    """Acceptance of every draft depth over AR runs from the prompts (their depth traces)."""
    depth = model.config.depth
    agree = {d: [] for d in range(1, depth)}
    for text in PROMPTS:
        ids = list(text.encode())
        run = generate(model, ids, max_new_tokens=new_tokens, depth_trace=True, record=False)
        for rec in run.depth_records:
            if rec.position >= len(ids):
                for d in agree:
                    agree[d].append(rec.predictions[d - 1] == rec.predictions[-1])
    return {d: sum(v) / len(v) for d, v in agree.items()}


def grid(depth: int) -> list[dict]:
    drafts = [d for d in (1, 2, 3, 4, 8) if d < depth]
    configs = [{"schedule": "ar"}]
    configs += [{"schedule": "dtv", "draft_depth": d, "block_length": k}
                for d in drafts for k in (2, 4, 8)]
    for d in drafts:
        width = wave_width(depth, d)
        configs += [{"schedule": "wfd", "draft_depth": d, "width_cap": None}]
        if width >= 4:
            configs += [{"schedule": "wfd", "draft_depth": d, "width_cap": width // 2}]
    return configs


def label(c: dict) -> str:
    if c["schedule"] == "ar":
        return "AR"
    if c["schedule"] == "dtv":
        return f"DtV k={c['block_length']} d={c['draft_depth']}"
    return f"WFD d={c['draft_depth']}" + (f" cap={c['width_cap']}" if c["width_cap"] else "")


def measure_case(model, configs: list[dict], new_tokens: int, repeats: int,
                 forced: dict[int, float] | None) -> dict[str, float]:
    rates: dict[str, list[float]] = {label(c): [] for c in configs}
    for _ in range(repeats):  # interleaved: each repeat runs every configuration once
        for c in configs:
            options = {k: v for k, v in c.items() if k != "schedule" and v is not None}
            alpha = None if forced is None or c["schedule"] == "ar" else forced[c["draft_depth"]]
            run = time_schedule(model, c["schedule"], prompts_for(model, 0, 1), new_tokens,
                                alpha, **options)
            rates[label(c)].append(run["tokens_per_s"])
    return {k: statistics.median(v) for k, v in rates.items()}


def case(name: str, model, hw, acceptance: dict[int, float], new_tokens: int, repeats: int,
         forced: bool) -> dict:
    prompt = len(PROMPTS[0].encode())
    wl = Workload(context_length=prompt, new_tokens=new_tokens, dtype="fp32")
    best = recommend(model.config, hw, acceptance, wl, top=1)[0]
    chosen = {"schedule": best.schedule, "draft_depth": best.draft_depth,
              "block_length": best.block_length, "width_cap": best.width_cap}
    configs = grid(model.config.depth)
    if label(chosen) not in {label(c) for c in configs}:
        configs.append(chosen)
    measured = measure_case(model, configs, new_tokens, repeats, acceptance if forced else None)
    top = max(measured, key=measured.__getitem__)
    return {"case": name, "recommended": label(chosen), "measured_recommended": measured[
        label(chosen)], "best": top, "measured_best": measured[top],
        "regret": 1 - measured[label(chosen)] / measured[top], "measured": measured}


def auto_overhead(model, hw, new_tokens: int, repeats: int) -> dict:
    """What --schedule auto adds to the run it chooses: the prefill's extra readouts (the probe;
    from both runs' call traces) and the search, against the chosen configuration run directly.
    The plain wall times are kept too (noisier: two whole runs)."""
    ids = list(PROMPTS[0].encode())

    def prefill_codas_s(run) -> float:
        return sum(r.wall_s for r in run.records if r.kind == "coda" and min(r.positions)
                   < len(ids))

    added, auto_s, direct_s = [], [], []
    for _ in range(repeats):
        auto = generate(model, ids, schedule="auto", max_new_tokens=new_tokens, hardware=hw)
        s = auto.stats
        direct = generate(model, ids, schedule=auto.schedule, max_new_tokens=new_tokens,
                          draft_depth=s.get("draft_depth"), block_length=s.get("block_length")
                          or 4, width_cap=s.get("width_cap"))
        added.append(prefill_codas_s(auto) - prefill_codas_s(direct) + s["auto"]["decide_s"])
        auto_s.append(auto.wall_s)
        direct_s.append(direct.wall_s)
    return {"choice": auto.stats["auto"]["choice"], "added_s": statistics.median(added),
            "auto_s": statistics.median(auto_s), "direct_s": statistics.median(direct_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random", default="ouro-base:random")
    parser.add_argument("--random-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--auto-only", action="store_true", help="time --schedule auto only")
    parser.add_argument("--transplant", action="store_true",
                        help="price the tiny models with the committed profile rescaled from "
                             "a few of their own calls timed here (what --schedule auto makes "
                             "on a machine nobody calibrated), not the profile itself")
    args = parser.parse_args()
    rows = []
    for name in () if args.auto_only else ("huginn-tiny", "ouro-tiny"):
        model = load_model(name)
        base = load_profile(PROFILES / f"cpu-{model.config.family}-fp32.json")
        if args.transplant:
            from wfd.transplant import transplant

            base = transplant(base, model, name, f"{base.machine}, timed again")
            print(base.checks[0], flush=True)
        hw = base.hardware
        acceptance = depth_acceptance(model, args.new_tokens)
        rows.append(case(name, model, hw, acceptance, args.new_tokens, args.repeats, False))
        print(rows[-1], flush=True)
    model = load_model("huginn-tiny" if args.auto_only else args.random)
    hw = load_profile(PROFILES / f"cpu-{model.config.family}-fp32.json").hardware
    for a0 in () if args.auto_only else (0.6, 0.8, 0.95):
        curve = acceptance_curve(model.config.depth, a0)
        rows.append(case(f"{args.random} a0={a0}", model, hw, curve, args.random_tokens,
                         args.repeats, True))
        print(rows[-1], flush=True)
    tiny = load_model("huginn-tiny")
    auto = auto_overhead(tiny, load_profile(PROFILES / "cpu-huginn-fp32.json").hardware,
                         args.new_tokens, args.repeats)
    lines = ["| case | recommended | its tokens/s | best measured | its tokens/s | regret |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['recommended']} | {r['measured_recommended']:.1f} | "
              f"{r['best']} | {r['measured_best']:.1f} | {r['regret']:.1%} |" for r in rows]
    regrets = [r["regret"] for r in rows] or [float("nan")]
    lines += ["", f"Regret: median {statistics.median(regrets):.1%}, max {max(regrets):.1%}.",
              "", f"`--schedule auto` on huginn-tiny ({args.new_tokens} tokens): chose "
              f"{auto['choice']}; the probe's readouts and the search added "
              f"{auto['added_s'] * 1e3:.1f} ms to a {auto['direct_s']:.3f} s run "
              f"({auto['added_s'] / auto['direct_s']:.1%}; whole runs: {auto['auto_s']:.3f} s "
              f"auto against {auto['direct_s']:.3f} s direct)."]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        atomic_write(args.out, table)


if __name__ == "__main__":
    script_main(main)
