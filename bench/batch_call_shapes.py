"""A batch's calls, one shape at a time, against their price: where a batch's calls leave the
cost model.

    python bench/batch_call_shapes.py [--model huginn-small:random] [--profile FILE]
        [--part block|prelude|coda] [--context 80] [--batches 1 2 4 8 16] [--ragged 0 7]
        [--repeats 3] [--threads 2] [--kernel] [--cold] [--json]

Each shape is one call of the decoder's ``--part`` over B sequences (``wfd.runtime.Runner`` on a
batched cache, eager). Block calls: B AR steps (one position each), B DtV verifications of k = 4
positions, or B WFD waves of 8 positions (each at its own depth; R positions where R < 8);
prelude calls: one position or four per sequence; coda calls: a readout at R per sequence, or at
d and R (a WFD tick's). Sequence
b sits at context ``--context`` + (b x RAGGED mod 40), so a ragged batch's sequences read key
sets of different lengths. Every shape is timed as the median of 5 calls, bracketed by the
calibration's canary product and taken again while the machine is busy, over ``--repeats``
interleaved rounds (the median of the rounds is reported), and priced by the profile
(``price_records``). Prints a Markdown table: the call's key sets (distinct (sequence, slot)
pairs), measured and predicted milliseconds, and their ratio.

``--cold`` times each call as a decode loop runs it after another part's call: before each of
the five, a buffer the size of the model's weights is read and written (the other parts' weights
pass through the cache), and prices it so (``call_cost``'s ``after_other_part``): the table then
shows each shape warm and cold, each against its own price.

``--kernel`` first times the attention kernel alone on this machine: the same keys' bytes (128
x 96 keys of 8 heads of 64, fp32, from memory: each repeat reads another copy) split into 1 to
256 key sets, with the time each (key set, head) pair adds over a single key set's rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from costmodel.clitools import script_main
from costmodel.profile import load_profile
from costmodel.simulate import price_records
from costmodel.store import PROFILES_DIR
from wfd.checkpoint import load_model
from wfd.runtime import Runner, make_cache
from wfd.timing import Quiet

SPREAD = 40  # the most a ragged batch's contexts differ by


def shapes(part: str, depth: int, draft_depth: int) -> dict[str, tuple[int, list[int]]]:
    """Each shape of one sequence's share of a call of ``part``: (positions, their depths)."""
    if part == "block":  # AR's step, DtV's verification (k = 4), a WFD wave of 8 (or R)
        width = min(8, depth)
        return {"ar": (1, [1]), "dtv": (4, [1] * 4), "wfd": (width, list(range(width, 0, -1)))}
    if part == "prelude":  # a new token (AR, WFD), a DtV round's k tokens
        return {"1 position": (1, [0]), "4 positions": (4, [0] * 4)}
    # a readout at R (AR), and at d and R together (WFD's draft and verification)
    return {"1 readout": (1, [depth]), "2 readouts": (2, [draft_depth, depth])}


def call_shape(share: tuple[int, list[int]], batch: int, context: int, ragged: int
               ) -> tuple[list[int], list[int], list[int]]:
    """(positions, depths, sequences) of one batched call: B sequences' shares."""
    count, share_depths = share
    positions, depths, sequences = [], [], []
    for b in range(batch):
        start = context + (b * ragged) % SPREAD
        positions += list(range(start, start + count))
        depths += share_depths
        sequences += [b] * count
    return positions, depths, sequences


def call_inputs(part: str, n: int, hidden: int, vocab: int) -> list[torch.Tensor]:
    if part == "prelude":
        return [torch.tensor([(7 * i) % vocab for i in range(n)])]
    state = torch.randn(n, hidden)
    return [state, torch.randn_like(state)] if part == "block" else [state]


def median_of_five(runner: Runner, part: str, positions: list[int], depths: list[int],
                   inputs: list[torch.Tensor], sequences: list[int],
                   evict: torch.Tensor | None = None) -> float:
    """The median of five calls; with ``evict``, each after that buffer is read and written."""
    runner.records.clear()
    for _ in range(5):
        if evict is not None:
            evict.add_(1.0)
        runner.run(part, positions, depths, inputs, sequences)
    return statistics.median(r.wall_s for r in runner.records)


def kernel_split() -> list[dict]:
    """The attention kernel over the same bytes in 1 to 256 key sets."""
    heads, head_dim, total_keys, copies = 8, 64, 128 * 96, 8
    rows = []
    base = None
    for sets in (1, 4, 16, 32, 64, 128, 256):
        span = total_keys // sets
        keys = torch.randn(copies, sets, heads, span, head_dim)
        values = torch.randn_like(keys)
        query = torch.randn(sets, heads, 1, head_dim)
        times = []
        for i in range(8 * copies):
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(query, keys[i % copies],
                                                             values[i % copies])
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[copies:])
        base = base if base is not None else t
        rows.append({"key_sets": sets, "keys_per_set": span, "us": t * 1e6,
                     "gb_per_s": 2 * keys[0].numel() * 4 / t / 1e9,
                     "us_per_pair": (t - base) / (sets * heads) * 1e6 if sets > 1 else None})
    return rows


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="huginn-small:random")
    ap.add_argument("--profile", default=None,
                    help="a calibration profile (default: this machine's for the family)")
    ap.add_argument("--part", choices=("block", "prelude", "coda"), default="block")
    ap.add_argument("--context", type=int, default=80)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--ragged", type=int, nargs="+", default=[0, 7])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--cold", action="store_true",
                    help="also time each call after the model's weights' worth of other bytes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.context < 1 or min(args.batches) < 1 or args.repeats < 1:
        raise SystemExit("context, batches and repeats must be at least 1")
    return args


def timed_shapes(model, args) -> tuple[list[tuple], dict, dict, dict]:
    """Every (shape, batch, raggedness, cold) point timed over interleaved repeats: the points,
    their times, the record of each point's call, and the load report."""
    cfg = model.config
    batches = sorted(set(args.batches))
    draft_depth = min(cfg.default_draft_depth or 1, cfg.depth - 1) if cfg.depth > 1 else 1
    part_shapes = shapes(args.part, cfg.depth, draft_depth)
    cache = make_cache(model, prompt_len=args.context + SPREAD + 8, max_new_tokens=8,
                       depth=cfg.depth, kv_sharing=0,
                       readout_depths=sorted({draft_depth, cfg.depth}),
                       sequences=max(batches))
    cache.fill(args.context + SPREAD + 16)
    runner = Runner(model, cache, record=True, mode="eager")
    quiet = Quiet("cpu")
    evict = (torch.ones(sum(p.numel() for p in model.parameters())) if args.cold else None)
    points = [(name, b, r, cold) for name in part_shapes for b in batches
              for r in sorted(set(args.ragged)) if not (b == 1 and r)
              for cold in ([False, True] if args.cold else [False])]
    measured: dict[tuple, list[float]] = {p: [] for p in points}
    records = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for point in points:
                positions, depths, sequences = call_shape(part_shapes[point[0]], point[1],
                                                          args.context, point[2])
                inputs = call_inputs(args.part, len(positions), cfg.hidden_size,
                                     cfg.vocab_size)
                call = (runner, args.part, positions, depths, inputs, sequences,
                        evict if point[3] else None)
                median_of_five(*call)  # warm
                measured[point].append(quiet.measure(lambda t: t, median_of_five, *call))
                records[point] = runner.records[0]
    return points, measured, records, quiet.report()


def print_tables(out: dict, args, profile_path) -> None:
    if args.kernel:
        print("Attention kernel alone, the same bytes in more key sets:\n\n"
              "| key sets | keys each | us | GB/s | us per (key set, head) beyond one set's rate |"
              "\n|---|---|---|---|---|")
        for k in out["kernel"]:
            extra = "-" if k["us_per_pair"] is None else f"{k['us_per_pair']:.2f}"
            print(f"| {k['key_sets']} | {k['keys_per_set']} | {k['us']:.0f} | "
                  f"{k['gb_per_s']:.1f} | {extra} |")
        print()
    load = out["load"]
    print(f"{args.model} {args.part} calls at context {args.context}, profile {profile_path}; "
          f"canary {load['canary_median']:.2f}x its fastest (median), "
          f"{load['retaken_fraction']:.0%} of measurements taken again\n")
    print("| call | batch | contexts apart | cache | key sets | measured ms | predicted ms | "
          "measured / predicted |\n|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['call']} | {r['batch']} | {r['ragged'] and 'ragged' or 'equal'} | "
              f"{'cold' if r['cold'] else 'warm'} | {r['key_sets']} | {r['measured_ms']:.2f} | "
              f"{r['predicted_ms']:.2f} | {r['ratio']:.2f} |")


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="fp32")
    cfg = model.config
    profile_path = args.profile or PROFILES_DIR / f"cpu-{cfg.family}-fp32.json"
    hw = load_profile(profile_path).hardware
    out: dict = {"model": args.model, "part": args.part, "profile": str(profile_path),
                 "context": args.context}
    if args.kernel:
        out["kernel"] = kernel_split()
    points, measured, records, load = timed_shapes(model, args)
    rows = []
    for point in points:
        record = records[point].model_copy()
        # cold: after another part's call
        before = ("coda" if args.part == "prelude" else "prelude") if point[3] else None
        price_records(cfg, hw, [record], dtype="fp32", before=before)
        t = statistics.median(measured[point])
        rows.append({"call": point[0], "batch": point[1], "ragged": point[2], "cold": point[3],
                     "key_sets": len(record.slot_contexts()), "measured_ms": t * 1e3,
                     "predicted_ms": record.wall_s * 1e3, "ratio": t / record.wall_s})
    out.update(rows=rows, load=load)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_tables(out, args, profile_path)

if __name__ == "__main__":
    script_main(main)
