"""vLLM as a peer: the same tiny models, prompts and weights decoded by vLLM (through the plugin
in wfd/serving: its AR, vLLM's DtV with the checkpoint drafting for itself at its draft depth,
and the plugin's own WFD and DtV in the engine, hf_overrides schedule wfd and dtv) and
by this project's AR, DtV and WFD, one request at a time and eight together, greedy, fp32, on
this machine's CPU.

    python bench/vllm_peer.py [--models huginn-tiny ouro-tiny] [--new-tokens 64] [--repeats 3]
        [--block-length 4] [--commit-ahead 8] [--threads 2] [--out FILE.json]

Needs the serve-cpu extra (vLLM's CPU build). vLLM runs in a process of its own
(wfd.serving.offline, eager: on this CPU faster than its torch.compile), started once per model
and configuration, its engine start excluded, twice: as vLLM runs by default (its engine core a
process of its own, beside the worker) and with the engine core in the client's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), and DtV (vLLM's draft_model method, k = --block-length
drafts at the model's draft depth, the engine core in-process), and the plugin's WFD and DtV
(k = --block-length, nested reuse) at the model's draft depth, their waves committing up to
--commit-ahead greedy tokens ahead of vLLM's sampler each step, the engine core in-process.
Each decodes the eight code prompts one request at a time, then all eight together, --repeats
times, and the median run is reported. This decoder runs the same prompts with `generate`
(batch 1) and `decode_batch` (batch 8) in this process, each schedule --repeats times,
interleaved. Tokens/s: new tokens over the run's wall time, prefills
included (vLLM's requests carry their prefill). Each vLLM mode's greedy tokens are checked
against AR's (exit 1 when they differ). For the plugin's WFD and DtV it also prints the wave's
block calls per new token of a request (from the wave's counters, the median over the
repeats): one block call advances every wave of the step, so at batch 8 it counts the calls
that eight tokens, one of each request, took; AR makes R of them per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from costmodel.clitools import script_main
from wfd.batch import Request, decode_batch
from wfd.checkpoint import load_model
from wfd.generate import generate
from wfd.serving.offline import run_apart

ROOT = Path(__file__).resolve().parents[1]
CODE = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Node:\n    def __init__(self",
        "for i in range(", "    return ", "def parse(text):\n    ", "# sort the list\n",
        "if __name__ == '__main__':\n    ", "x = [i * i for i in "]
SCHEDULES = ("ar", "dtv", "wfd")


def vllm_runs(folder: Path, prompts: list[list[int]], new_tokens: int, repeats: int,
              threads: int, in_process: bool, speculative_tokens: int | None = None,
              overrides: dict | None = None
              ) -> tuple[list[float], list[float], list[list[list[int]]], dict[int, dict]]:
    """(seconds per batch-1 run, seconds per batch-8 run, each run's tokens, and for the
    plugin's own schedules the wave's figures at each batch: block calls per new token of a
    request, and the share of its drafts accepted) from one engine (``speculative_tokens``: DtV, the
    checkpoint drafting that many tokens for itself; ``overrides``: the plugin's options, e.g.
    WFD's)."""
    runs = [{"prompts": prompts, "max_tokens": new_tokens, "batch": batch}
            for _ in range(repeats) for batch in (1, 8)]
    results = run_apart({"model": str(folder), "runs": runs, "in_process": in_process,
                         "speculative_tokens": speculative_tokens, "overrides": overrides},
                        env={**os.environ, "OMP_NUM_THREADS": str(threads)})["runs"]
    calls: dict[int, list[float]] = {1: [], 8: []}
    verified: dict[int, list[int]] = {1: [0, 0], 8: [0, 0]}
    before = {"block_calls": 0, "verified": 0, "accepted": 0}
    for run, done in zip(runs, results, strict=True):  # the wave's counters: the engine's so far
        if "wave" in done:
            new = {key: done["wave"][key] - before[key] for key in before}
            rounds = len(prompts) * new_tokens / run["batch"]  # a token of each request
            calls[run["batch"]].append(new["block_calls"] / rounds)
            verified[run["batch"]][0] += new["verified"]
            verified[run["batch"]][1] += new["accepted"]
            before = {key: done["wave"][key] for key in before}
    return ([r["seconds"] for r in results[0::2]], [r["seconds"] for r in results[1::2]],
            [r["tokens"] for r in results],
            {b: {"block_calls_per_token": statistics.median(v),
                 "acceptance": verified[b][1] / verified[b][0]} for b, v in calls.items() if v})


def ours(model, prompts: list[list[int]], schedule: str, batch: int, new_tokens: int,
         block_length: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    if batch == 1:
        tokens = [generate(model, p, schedule=schedule, max_new_tokens=new_tokens,
                           block_length=block_length, record=False).tokens for p in prompts]
    else:
        run = decode_batch(model, [Request(i, p, new_tokens) for i, p in enumerate(prompts)],
                           schedule=schedule, batch_size=batch, block_length=block_length)
        tokens = [r.tokens for r in sorted(run.results, key=lambda r: r.index)]
    return time.perf_counter() - started, tokens


# the --out keys of vLLM's AR runs' seconds (the others: vllm_MODE_runs_s)
RUNS_KEY = {"ar": "vllm_runs_s", "ar_in_process": "vllm_in_process_runs_s"}


def vllm_modes(args) -> dict[str, dict]:
    """vLLM's modes, each an engine of its own: the options of ``vllm_runs`` by mode."""
    return {"ar": {"in_process": False}, "ar_in_process": {"in_process": True},
            "dtv": {"in_process": True, "speculative_tokens": args.block_length},
            "wfd": {"in_process": True,
                    "overrides": {"schedule": "wfd", "commit_ahead": args.commit_ahead}},
            "plugin_dtv": {"in_process": True,
                           "overrides": {"schedule": "dtv", "block_length": args.block_length,
                                         "commit_ahead": args.commit_ahead}}}


def our_times(name: str, prompts: list[list[int]], args, vllm: dict) -> dict:
    """This decoder's seconds per run of each schedule at each batch, its repeats interleaved;
    exits when a vLLM mode's greedy tokens are not its AR's."""
    model = load_model(name)
    times = {(s, b): [] for s in SCHEDULES for b in (1, 8)}
    for _ in range(args.repeats):  # interleaved: each repeat runs every configuration
        for schedule in SCHEDULES:
            for batch in (1, 8):
                seconds, tokens = ours(model, prompts, schedule, batch, args.new_tokens,
                                       args.block_length)
                times[schedule, batch].append(seconds)
                for mode, (_, _, runs, _) in vllm.items():
                    if schedule == "ar" and batch == 1 and any(t != tokens for t in runs):
                        sys.exit(f"error: vLLM's {mode} greedy tokens differ from AR's on "
                                 f"{name}")
    return times


def model_rows(name: str, prompts: list[list[int]], args) -> list[dict]:
    """One model's rows, batch 1 and 8: tokens/s of every vLLM mode and of this decoder."""
    folder = ROOT / "wfd" / "models" / name
    vllm = {mode: vllm_runs(folder, prompts, args.new_tokens, args.repeats, args.threads,
                            **options) for mode, options in vllm_modes(args).items()}
    times = our_times(name, prompts, args, vllm)
    total = len(prompts) * args.new_tokens
    rows = []
    for index, batch in enumerate((1, 8)):
        seconds = {mode: runs[index] for mode, runs in vllm.items()}
        waves = {mode: vllm[mode][3][batch] for mode in ("wfd", "plugin_dtv")}
        rows.append({"model": name, "batch": batch,
                     **{f"vllm_{mode}_tokens_per_s": total / statistics.median(v)
                        for mode, v in seconds.items()},
                     **{f"{s}_tokens_per_s": total / statistics.median(times[s, batch])
                        for s in SCHEDULES},
                     **{RUNS_KEY.get(mode, f"vllm_{mode}_runs_s"): v
                        for mode, v in seconds.items()},
                     **{f"vllm_{mode}_{key}": value for mode, figures in waves.items()
                        for key, value in figures.items()},
                     "runs_s": {s: times[s, batch] for s in SCHEDULES}})
    return rows


def table_line(row: dict) -> str:
    def v(key: str) -> float:
        return row[f"{key}_tokens_per_s"]
    ar, ar_in = v("vllm_ar"), v("vllm_ar_in_process")
    return (f"| {row['model']} | {row['batch']} | {ar:.1f} | {ar_in:.1f} | {v('vllm_dtv'):.1f} | "
            f"{v('vllm_wfd'):.1f} | {v('vllm_plugin_dtv'):.1f} | {v('ar'):.1f} | {v('dtv'):.1f} | "
            f"{v('wfd'):.1f} | {ar / v('ar'):.2f}x, {ar_in / v('ar'):.2f}x"
            f" | {v('vllm_dtv') / ar_in:.2f}x | {v('vllm_wfd') / ar_in:.2f}x | "
            f"{v('vllm_plugin_dtv') / ar_in:.2f}x | {v('wfd') / ar:.2f}x | "
            f"{v('vllm_wfd') / v('wfd'):.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["huginn-tiny", "ouro-tiny"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-length", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--commit-ahead", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [list(text.encode()) for text in CODE]
    k = args.block_length
    print(f"| model | batch | vLLM AR | vLLM AR, engine in-process | vLLM DtV k={k} | vLLM WFD | "
          f"vLLM plugin DtV | AR | DtV k={k} | WFD | vLLM AR / AR | vLLM DtV / vLLM AR | "
          "vLLM WFD / vLLM AR | vLLM plugin DtV / vLLM AR | WFD / vLLM AR | vLLM WFD / WFD |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        rows += model_rows(name, prompts, args)
        for row in rows[-2:]:
            print(table_line(row), flush=True)
    print("\nThe plugin's waves, block calls per new token of a request (AR: R):")
    for row in rows:
        print(f"{row['model']}, batch {row['batch']}: WFD "
              f"{row['vllm_wfd_block_calls_per_token']:.2f}, plugin DtV "
              f"{row['vllm_plugin_dtv_block_calls_per_token']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "new_tokens": args.new_tokens, "prompts": len(prompts),
            "prompt_tokens_mean": statistics.mean(map(len, prompts)),
            "block_length": args.block_length, "commit_ahead": args.commit_ahead,
            "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    script_main(main)
