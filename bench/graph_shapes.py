"""How many CUDA graphs a graphs-mode run captures, counted without a GPU: the decode calls of the
simulator's graphs-mode trace (which the decoder's static mode equals call for call,
tests/test_plans.py), each shape being a part, its slots and its static span.

    python bench/graph_shapes.py [--models huginn-3.5b ouro-2.6b] [--context 1024]
        [--new-tokens 256] [--block-lengths 2 4 8] [--acceptance 0.9]

Prints, per model and schedule (draft depth 4 for Huginn, 1 for Ouro, as the GPU bench runs
them), the shapes captured, how many per span, the spans crossed, and the static cache's bytes.
"""

from __future__ import annotations

import argparse

from costmodel import AR, WFD, DtV, Workload, get_hardware, get_model, simulate
from costmodel.clitools import script_main
from costmodel.memory import kv_cache_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["huginn-3.5b", "ouro-2.6b"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-lengths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--acceptance", type=float, default=0.9)
    args = ap.parse_args()
    graphs = get_hardware("h200").in_mode("graphs")
    print(f"context {args.context}, {args.new_tokens} new tokens, forced acceptance "
          f"{args.acceptance}\n")
    print("| model | schedule | shapes | per span | spans | static KV cache |\n"
          "|---|---|---|---|---|---|")
    for name in args.models:
        model = get_model(name)
        d = 4 if model.family == "huginn" else 1
        schedules = [AR(), *(DtV(block_length=k, draft_depth=d) for k in args.block_lengths),
                     WFD(draft_depth=d)]
        for schedule in schedules:
            run = simulate(model, graphs, schedule, context_length=args.context,
                           new_tokens=args.new_tokens, acceptance=args.acceptance,
                           prefill=True)
            decode = [r for r in run.records if max(r.positions) >= args.context]
            shapes = {(r.kind, tuple(r.slots), r.contexts[0]) for r in decode}
            spans = sorted({span for *_, span in shapes})
            ahead = schedule.lookahead(model.default_depth)
            kv = kv_cache_bytes(model, Workload(context_length=args.context,
                                                new_tokens=args.new_tokens),
                                depth=model.default_depth,
                                readout_depths=1 if schedule.kind == "ar" else 2,
                                lookahead=ahead, static=True)
            label = schedule.kind.upper() if schedule.kind != "dtv" else (
                f"DtV k={schedule.block_length}")
            print(f"| {name} | {label} d={d} | {len(shapes)} | "
                  f"{len({s[:2] for s in shapes})} | {', '.join(map(str, spans))} | "
                  f"{kv / 1e9:.2f} GB |")


if __name__ == "__main__":
    script_main(main)
