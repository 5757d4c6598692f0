"""Tensor parallelism on vLLM's CPU build beside the cost model's: tokens/s of the plugin's AR
on one rank and on two, and `costmodel predict --engine vllm --tensor-parallel 2`'s.

    python bench/vllm_tensor_parallel.py --profile PROFILE.json [--model ouro-small]
        [--depth R] [--prompts 4] [--prompt-tokens 32] [--new-tokens 16] [--batches 1 4]
        [--out FILE.json]

Random weights of a cost-model preset's architecture (one whose heads and MLP split over two
ranks: the tiny ones' 3 heads do not), saved in the public layout, served by the plugin at
``--depth`` (default: the preset's R), fp32, eager. Each (ranks, batch) is one engine in a
process of its own (``wfd.serving.offline``; one rank's in-process, on every core; two ranks'
each bound to a core of its own): a run of the prompts, a batch at a time, prefills included,
as bench/vllm_peer.py counts. The engine's own time per step, which the profile's per-call
costs do not hold, is fitted from the one-rank run at each batch (measured less predicted);
the two-rank run at that batch is then predicted with it, each rank a share of the model on
half the CPU, joined by vLLM's shared-memory all-reduce (the cpu-shm link, bench/cpu_link.py).
Needs the serve-cpu extra.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from costmodel.clitools import script_main
from costmodel.engines import EngineOverheads, for_engine
from costmodel.predict import predict
from costmodel.presets import get_model
from costmodel.profile import load_profile
from costmodel.workload import Workload
from wfd.serving.offline import run_apart


def checkpoint(preset: str, folder: Path) -> Path:
    """Random weights of ``preset``'s architecture, in the public layout."""
    from wfd.checkpoint import load_model, save

    return save(load_model(f"{preset}:random"), folder)


def measured(folder: Path, ranks: int, batch: int, prompts: list[list[int]], new: int,
             depth: int | None) -> float:
    """Tokens/s of a run of ``prompts`` on ``ranks`` ranks, ``batch`` at a time."""
    # one rank in-process: a served engine (its scheduler in a process of its own) keeps a core
    # of the CPU for the scheduler and runs the model on the rest, on this 2-core machine one
    job = {"model": str(folder), "tensor_parallel": ranks, "eager": True,
           "in_process": ranks == 1,
           "max_model_len": len(prompts[0]) + new + 16,  # the KV the runs need, no more
           "overrides": {"recurrence_depth": depth} if depth else None,
           "runs": [{"prompts": prompts[:batch], "max_tokens": 2, "batch": batch},  # warm-up
                    {"prompts": prompts, "max_tokens": new, "batch": batch}]}
    run = run_apart(job, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
                    timeout=1800)["runs"][1]
    return sum(map(len, run["tokens"])) / run["seconds"]


def predicted(spec, hw, ranks: int, batch: int, args, engine: EngineOverheads | None
              ) -> float:
    """Tokens/s the model predicts for the same run (vLLM's kernel counts, eager)."""
    workload = Workload(context_length=args.prompt_tokens, new_tokens=args.new_tokens,
                        batch_size=batch, prompts=args.prompts, dtype="fp32", depth=args.depth)
    result = predict(spec, for_engine("vllm", hw, spec), workload, engine=engine,
                     tensor_parallel=ranks, link="cpu-shm" if ranks > 1 else None)
    return result.schedules["ar"].tokens_per_s


def engine_at(spec, hw, args, batch: int, tokens_per_s: float) -> EngineOverheads:
    """The engine's own time per step at ``batch`` on one rank: what the run measured beyond
    the profile's per-call costs (per token of the batch, measured less predicted, times the
    batch's tokens a step). Fitted batch by batch, so that the one-rank rows are matched and
    the two-rank rows test the split and the link alone."""
    extra = batch / tokens_per_s - batch / predicted(spec, hw, 1, batch, args, None)
    return EngineOverheads(step_s=max(0.0, extra * batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--model", default="ouro-small")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec, hw = get_model(args.model), load_profile(args.profile).hardware
    from costmodel.parallel import check_degree

    check_degree(spec, 2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(spec.vocab_size, size=args.prompt_tokens).tolist()
               for _ in range(args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoint(args.model, Path(tmp) / args.model)
        runs = {(r, b): measured(folder, r, b, prompts, args.new_tokens, args.depth)
                for r in (1, 2) for b in args.batches}
    engines = {b: engine_at(spec, hw, args, b, runs[(1, b)]) for b in args.batches}
    print(f"{args.model}, R = {args.depth or spec.default_depth}, {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new")
    print("batch  engine ms/step  1 rank tok/s  2 ranks tok/s  predicted  error  "
          "2/1 measured  2/1 predicted")
    for batch in args.batches:
        one, two = runs[(1, batch)], runs[(2, batch)]
        bare = predicted(spec, hw, 1, batch, args, None), predicted(spec, hw, 2, batch, args,
                                                                     None)
        guess = predicted(spec, hw, 2, batch, args, engines[batch])
        one_guess = predicted(spec, hw, 1, batch, args, engines[batch])
        rows.append({"batch": batch, "engine_step_s": engines[batch].step_s,
                     "one_rank_tokens_per_s": one, "two_ranks_tokens_per_s": two,
                     "predicted_two_ranks_tokens_per_s": guess,
                     "predicted_one_rank_tokens_per_s": one_guess,
                     "predicted_bare_tokens_per_s": list(bare)})
        print(f"{batch:>5}  {engines[batch].step_s * 1e3:>14.1f}  {one:>12.1f}  {two:>13.1f}  "
              f"{guess:>9.1f}  {guess / two - 1:+5.0%}  {two / one:>12.2f}  "
              f"{guess / one_guess:>13.2f}")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "depth": args.depth,
                                        "profile": str(args.profile), "rows": rows},
                                       indent=2))


if __name__ == "__main__":
    script_main(main)
