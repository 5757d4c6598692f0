"""AR vs DtV (best k) vs WFD tokens/s on this machine, per execution mode, and the cost of one
block call vs the number of positions in it.

    python bench/decode_speed.py schedules [--models huginn-tiny ouro-tiny huginn-mid:random
        ouro-mid:random] [--modes eager static] [--device cpu] [--context 0] [--repeats 5]
        [--new-tokens 64] [--acceptance 0.9] [--threads 2] [--reference-huginn DIR]
        [--reference-ouro DIR] [--reference-seconds S] [--exit-depths "16:0.5,32:0.5"]
        [--out FILE.json]
    python bench/decode_speed.py block-calls [--model huginn-mid:random] [--dtype fp32 bf16]
        [--threads 1 2]
    python bench/decode_speed.py operations [--models huginn-3.5b ouro-2.6b] [--dtypes fp32 bf16]

Runs are interleaved (each repeat runs every configuration once, in turn) and the median is
reported. A trained model decodes for real; a random-weight model (PRESET:random) uses the
forced-acceptance mode at --acceptance, which times the schedule without a real decode (flagged in
the table). --context N decodes after a prompt of N tokens instead of the three code prompts.
--exit-depths DIST times every schedule with adaptive depth, each token exiting at a depth drawn
from DIST (forced exits, costmodel.exits.ForcedExits: not a real decode, flagged), what
`costmodel predict --exit-depths DIST` prices.

Columns: tokens/s over the whole run (prefill included, as the WFD paper reports); ms per decoded
token (after the first token); the fraction of the bandwidth roofline the decode reaches (the bytes
its calls read per token, counted by the cost model from the run's call trace, over this device's
measured copy bandwidth, divided by the measured ms per token); the speedup over AR in the same
mode. Capture and warm-up time (static and graphs modes) is excluded. With --reference-huginn or
--reference-ouro (a folder holding the public reference modeling code, see
bench/reference_parity.py), the reference implementation's own cached `generate` runs on the same
weights as the baseline (it needs its transformers in this environment), --repeats passes after
the others, and the last column gives each row's decode speed over it (its ms per decoded token,
the prefill taken out by a one-token run, over the row's). A reference that fails, or runs past
--reference-seconds, is named after the table, which is kept, and the script exits 1.
Prints a Markdown table for docs/ and, with --out, writes its rows as JSON.

`operations` counts what the decoder dispatches per layer and per call of each part, by class, as
a calibration counts it (calibrate.operations.decoder_operations): matrix products, attention and
other kernels, and views (no kernel). The counts do not depend on widths, so each preset is
counted on a narrow copy with its own layers, heads ratio and options (`python -m
calibrate.tables --write` writes the table `costmodel` prices a preset's operations with).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from costmodel.clitools import script_main
from costmodel.exits import ForcedExits
from costmodel.predict import resolve_draft_depth
from costmodel.presets import get_hardware
from costmodel.schedules import wave_width
from costmodel.simulate import price_bytes
from costmodel.trace import atomic_write
from wfd.checkpoint import DTYPE_NAMES, DTYPES, load_model
from wfd.generate import generate, make_cache, prefill
from wfd.runtime import Runner, default_mode

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        ",
    "    for i, line in enumerate(lines):\n        if ",
]


def prompts_for(model, context: int, count: int) -> list[list[int]]:
    """The code prompts as bytes, or ``count`` synthetic prompts of ``context`` tokens."""
    if context:
        vocab = model.config.vocab_size
        return [[(97 * i + 13 * j) % vocab for i in range(context)] for j in range(count)]
    return [list(text.encode()) for text in PROMPTS[:count]]


def time_schedule(model, schedule: str, prompts: list[list[int]], new_tokens: int,
                  forced: float | None, **kw) -> dict:
    """Tokens per second over the prompts, and ms per decoded token after the first."""
    tokens, wall, decode_s, decoded, accepted = 0, 0.0, 0.0, 0, []
    for ids in prompts:
        res = generate(model, ids, schedule=schedule, max_new_tokens=new_tokens,
                       force_acceptance=forced if schedule != "ar" else None, record=False, **kw)
        tokens += len(res.tokens)
        wall += res.wall_s
        decode_s += res.wall_s - res.stats["time_to_first_token_s"]
        decoded += len(res.tokens) - 1
        if res.stats.get("acceptance") is not None:
            accepted.append(res.stats["acceptance"])
    return {"tokens_per_s": tokens / wall, "ms_per_token": 1e3 * decode_s / max(decoded, 1),
            "acceptance": statistics.mean(accepted) if accepted else None}


def decode_bytes_per_token(model, schedule: str, prompt: list[int], new_tokens: int,
                           forced: float | None, **kw) -> float:
    """Bytes the decode's calls read and write per token after the first (cost model counts
    over the run's own call trace; the prefill's calls are left out)."""
    res = generate(model, prompt, schedule=schedule, max_new_tokens=new_tokens,
                   force_acceptance=forced if schedule != "ar" else None, record=True, **kw)
    decode = [r for r in res.records if min(r.positions) >= len(prompt)]
    dtype = DTYPE_NAMES[next(model.parameters()).dtype]
    return price_bytes(model.config, get_hardware("h200"), decode, dtype=dtype) / max(
        len(res.tokens) - 1, 1)


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str):
    """Raise TimeoutError in this (the main) thread once ``seconds`` have passed (None: no
    limit): a reference that loads or generates for ever must not cost a lent GPU its lease."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def reference_rate(family: str, folder: str, model, prompts: list[list[int]], new_tokens: int,
                   repeats: int = 1) -> dict:
    """Tokens/s of the public reference implementation's cached greedy `generate` on the same
    weights (saved in the public layout and loaded with its own class), and its ms per decoded
    token: a run of one token (the prefill) taken from a run of ``new_tokens``; medians of
    ``repeats`` passes over the prompts."""
    sys.path.insert(0, str(Path(__file__).parent))
    from reference_parity import import_reference

    from wfd.checkpoint import save

    package = import_reference(folder)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory() as tmp:
        save(model, tmp)
        if family == "huginn":
            mod = importlib.import_module(f"{package}.raven_modeling_minimal")
            ref = mod.RavenForCausalLM.from_pretrained(tmp, torch_dtype=dtype)
            extra = {"num_steps": model.config.depth}
        else:
            mod = importlib.import_module(f"{package}.modeling_ouro")
            ref = mod.OuroForCausalLM.from_pretrained(tmp, torch_dtype=dtype)
            extra = {}
    ref = ref.to(device).eval()

    def timed(ids: list[int], tokens: int) -> float:
        x = torch.tensor([ids], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ref.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           use_cache=True, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] - len(ids) == tokens
        return time.perf_counter() - t0

    timed(prompts[0], 2)  # warm-up
    passes = []
    for _ in range(repeats):
        runs = [(timed(ids, new_tokens), timed(ids, 1)) for ids in prompts]
        passes.append({"tokens_per_s": new_tokens * len(prompts) / sum(w for w, _ in runs),
                       "ms_per_token": 1e3 * sum(w - p for w, p in runs)
                       / ((new_tokens - 1) * len(prompts))})
    return {key: statistics.median(p[key] for p in passes) for key in passes[0]}


def schedule_configs(model, args) -> dict[str, tuple[str, dict]]:
    """AR, DtV at each block length and WFD, at the draft depth asked (or the model's), each
    with the forced exits asked."""
    depth = model.config.depth
    d = resolve_draft_depth(model.config, depth, None, args.draft_depth)
    exits = {} if args.exit_depths is None else {
        "exit_rule": ForcedExits.parse(args.exit_depths, depth)}
    configs = {"AR": ("ar", exits)}
    for k in args.block_lengths:
        configs[f"DtV k={k} d={d}"] = ("dtv", {"block_length": k, "draft_depth": d, **exits})
    configs[f"WFD d={d} W={wave_width(depth, d)}"] = ("wfd", {"draft_depth": d, **exits})
    return configs


def model_rows(name: str, model, prompts: list[list[int]], args, modes: list[str],
               bandwidth: float) -> list[dict]:
    """One model's rows: AR, the best DtV and WFD in each mode, medians over interleaved
    repeats, with the fraction of the bandwidth roofline each reaches."""
    forced = args.acceptance if name.endswith(":random") else None
    configs = schedule_configs(model, args)
    runs = [(mode, label) for mode in modes for label in configs]
    results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for mode in modes:  # warm-up; in static and graphs modes AR's shapes, kept for the runs
        time_schedule(model, "ar", prompts[:1], 4, None, mode=mode)
    for _ in range(args.repeats):
        for mode, label in runs:
            schedule, kw = configs[label]
            results[mode, label].append(time_schedule(model, schedule, prompts,
                                                      args.new_tokens, forced, mode=mode, **kw))
    byte_counts = {label: decode_bytes_per_token(model, configs[label][0], prompts[0],
                                                 args.new_tokens, forced, **configs[label][1])
                   for label in configs}
    def decode(label: str) -> str:  # what was forced in the label's runs
        return ", ".join((["forced acceptance"] if forced is not None and label != "AR" else [])
                         + (["forced exits " + args.exit_depths]
                            if args.exit_depths is not None else [])) or "real"

    rows = []
    for mode in modes:
        def median(label: str, key: str, mode=mode) -> float:
            return statistics.median(r[key] for r in results[mode, label])

        ar = median("AR", "tokens_per_s")
        best_dtv = max((lab for lab in configs if lab.startswith("DtV")),
                       key=lambda lab: median(lab, "tokens_per_s"))
        for label in configs:
            if label.startswith("DtV") and label != best_dtv:
                continue
            ms = median(label, "ms_per_token")
            rows.append({
                "model": name, "dtype": args.dtype, "mode": mode, "schedule": label,
                "tokens_per_s": median(label, "tokens_per_s"), "ms_per_token": ms,
                "roofline_fraction": byte_counts[label] / bandwidth / (ms / 1e3),
                "speedup_vs_ar": median(label, "tokens_per_s") / ar,
                "acceptance": results[mode, label][-1]["acceptance"],
                "decode": decode(label)})
    return rows


def reference_row(name: str, model, reference: str, prompts: list[list[int]], args,
                  rows: list[dict]) -> dict:
    """The public reference's generate on the same prompts, its load and runs under a time
    limit; ``rows`` of the model gain their decode speed over it."""
    started = time.perf_counter()
    with time_limit(args.reference_seconds, "its load and runs"):
        ref = reference_rate(model.config.family, reference, model, prompts,
                             args.reference_tokens, args.repeats)
    for row in rows:  # decode speed over the reference's, ms per token against ms
        if row["model"] == name:
            row["x_reference"] = ref["ms_per_token"] / row["ms_per_token"]
    return {"model": name, "dtype": args.dtype, "mode": "reference",
            "schedule": f"reference generate (AR, {args.reference_tokens} new tokens)", **ref,
            "roofline_fraction": None, "speedup_vs_ar": None, "acceptance": None,
            "decode": "real", "reference_s": time.perf_counter() - started}


def print_schedules(rows: list[dict], args, bandwidth: float) -> None:
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ({args.device}, {args.dtype}); medians of "
          f"{args.repeats}; context {args.context or 'code prompts'}, {args.new_tokens} new "
          "tokens\n")
    against = any("x_reference" in r for r in rows)  # a column only where a reference ran
    print("| model | mode | schedule | tokens/s | ms/token | roofline | speedup vs AR | "
          "acceptance | decode |" + (" decode x reference |" if against else "")
          + "\n|---|---|---|---|---|---|---|---|---|" + ("---|" if against else ""))

    def fmt(value, spec: str, suffix: str = "") -> str:
        return "" if value is None else f"{value:{spec}}{suffix}"

    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['schedule']} | {r['tokens_per_s']:.1f} | "
              f"{fmt(r['ms_per_token'], '.2f')} | {fmt(r['roofline_fraction'], '.0%')} | "
              f"{fmt(r['speedup_vs_ar'], '.2f', 'x')} | {fmt(r['acceptance'], '.2f')} | "
              f"{r['decode']} |" + (f" {fmt(r.get('x_reference'), '.2f', 'x')} |"
                                    if against else ""))


def schedules(args) -> None:
    from calibrate.machine import memory_bandwidth

    torch.set_num_threads(args.threads)
    modes = args.modes or [default_mode(args.device)]
    bandwidth = memory_bandwidth(args.device, args.dtype)
    rows, failed = [], []
    for name in args.models:
        model = load_model(name, dtype=args.dtype, device=args.device)
        prompts = prompts_for(model, args.context, args.prompts)
        rows += model_rows(name, model, prompts, args, modes, bandwidth)
        reference = {"huginn": args.reference_huginn, "ouro": args.reference_ouro}[
            model.config.family]
        if reference:
            try:
                rows.append(reference_row(name, model, reference, prompts, args, rows))
            except Exception as exc:  # noqa: BLE001 - the table above must survive its baseline
                failed.append(f"{name}: the reference generate failed: {type(exc).__name__}: "
                              f"{exc}")
    print_schedules(rows, args, bandwidth)
    if args.out:
        atomic_write(args.out, json.dumps({"device": args.device, "bandwidth_bytes_per_s":
                                           bandwidth, "rows": rows}, indent=2) + "\n")
    if failed:  # after the table and its file: a baseline that failed costs only itself
        raise SystemExit("\n".join(failed))


@torch.inference_mode()
def block_calls(args) -> None:
    print("| model | dtype | threads | positions per call | ms per block call | x one position |"
          "\n|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype)
        depth = model.config.depth
        for threads in args.threads_list:
            torch.set_num_threads(threads)
            base = None
            for n in args.positions:
                prompt = [32 + i % 200 for i in range(args.context)]
                cache = make_cache(model, prompt_len=len(prompt), max_new_tokens=n + 1,
                                   depth=depth, kv_sharing=0, readout_depths=[depth])
                runner = Runner(model, cache, record=False)
                prefill(runner, prompt, depth, [depth])
                positions = list(range(len(prompt), len(prompt) + n))
                e, state = runner.prelude([65] * n, positions)
                times = []
                for rep in range(args.repeats + 2):
                    cache.truncate(len(prompt))  # the same call again, at the same context
                    t0 = time.perf_counter()
                    runner.block(state, e, positions, [1] * n)
                    if rep >= 2:  # two warm-up calls
                        times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3
                base = base or ms
                print(f"| {args.model} | {dtype} | {threads} | {n} | {ms:.2f} | "
                      f"{ms / base:.2f} |")


def operations(args) -> None:
    from calibrate.operations import decoder_operations, narrow_model

    print("| model | dtype | per layer: operations | kernels (matmul, attention, other) | views |"
          " per call outside the layers (prelude, block, coda) |\n|---|---|---|---|---|---|")
    for name in args.models:
        for dtype in args.dtypes:
            ops = decoder_operations([narrow_model(name, dtype)])
            by = ops.layer_by_class
            kernels = by["matmul"] + by["attention"] + by["other"]
            print(f"| {name} | {dtype} | {ops.per_layer} | {kernels} ({by['matmul']}, "
                  f"{by['attention']}, {by['other']}) | {by['view']} | "
                  f"{', '.join(str(ops.extras[p]) for p in ('prelude', 'block', 'coda'))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("schedules")
    s.add_argument("--models", nargs="+", default=["huginn-tiny", "ouro-tiny",
                                                   "huginn-mid:random", "ouro-mid:random"])
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--acceptance", type=float, default=0.9)
    s.add_argument("--draft-depth", type=int, default=None)
    s.add_argument("--block-lengths", type=int, nargs="+", default=[2, 4, 8])
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--prompts", type=int, default=len(PROMPTS))
    s.add_argument("--dtype", default="fp32")
    s.add_argument("--device", default="cpu")
    s.add_argument("--modes", nargs="+", choices=("eager", "static", "graphs"), default=None,
                   help="default: graphs on CUDA, eager on CPU")
    s.add_argument("--context", type=int, default=0,
                   help="prompt length in tokens (0: the three code prompts)")
    s.add_argument("--reference-huginn", default=None)
    s.add_argument("--reference-ouro", default=None)
    s.add_argument("--reference-tokens", type=int, default=32,
                   help="new tokens per reference run (it is slow: tokens/s is what counts)")
    s.add_argument("--reference-seconds", type=float, default=None,
                   help="give up a reference (load and runs) after this long, the table kept")
    s.add_argument("--exit-depths", default=None,
                   help="forced exits: each token exits at a depth drawn from this distribution")
    s.add_argument("--out", default=None)
    b = sub.add_parser("block-calls")
    b.add_argument("--model", default="huginn-mid:random")
    b.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    b.add_argument("--threads-list", type=int, nargs="+", default=[1, 2])
    b.add_argument("--positions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b.add_argument("--context", type=int, default=256)
    b.add_argument("--repeats", type=int, default=9)
    o = sub.add_parser("operations")
    o.add_argument("--models", nargs="+", default=["huginn-3.5b", "ouro-2.6b"])
    o.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    args = parser.parse_args()
    if getattr(args, "repeats", 1) < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if getattr(args, "reference_tokens", 2) < 2:  # a decoded token beside the prefill's
        parser.error(f"--reference-tokens must be at least 2, not {args.reference_tokens}")
    if getattr(args, "reference_seconds", None) is not None and args.reference_seconds <= 0:
        parser.error(f"--reference-seconds must be positive, not {args.reference_seconds}")
    {"schedules": schedules, "block-calls": block_calls, "operations": operations}[args.what](args)


if __name__ == "__main__":
    script_main(main)
