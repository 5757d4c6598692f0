"""Batched decoding against the cost model: tokens/s of AR, DtV (best k) and WFD at batch sizes
B, measured with `wfd.batch.decode_batch` and predicted by `costmodel predict --batch B` with this
machine's calibration profile.

    python bench/batch_decode.py [--model huginn-small:random] [--profile FILE]
        [--batches 1 2 4 8 16] [--block-lengths 2 4 8] [--context 32] [--new-tokens 32]
        [--acceptance 0.9] [--repeats 3] [--retries 2] [--threads 2] [--device cpu]
        [--dtype fp32] [--mode eager|static] [--out FILE.json] [--figure FILE.png]
        [--measured FILE.json]

On a GPU: --device cuda --dtype bf16 --profile gpu-FAMILY-bf16.json (an eager calibration), in
eager mode (calibrate/gpu.sh runs it so).

Each batch decodes B synthetic prompts of --context tokens, --new-tokens each, admitted together;
a random-weight model times the schedule with forced acceptance (each sequence its own seeded
outcomes). Throughput is the decode's: tokens after each sequence's first, over the time outside
the prefills, as the cost model's per-token latency counts it. Runs are interleaved (each repeat
runs every configuration once) and medians reported. As the calibration measures, a run whose
canary product (timed before and after it) ran more than 1.2x its fastest is run again, at most
--retries times, keeping the fastest; the output says how much of the bench ran under load. The
prediction uses the acceptance the forced outcomes actually gave (a few dozen draws per sequence
wander from --acceptance), DtV's best k among --block-lengths on both sides, and WFD at the
model's default draft depth. The KV cache each batch allocates is checked against the
prediction's.

Prints Markdown tables: the measured speedups over AR at each batch; the predicted ones, for a
batch kept full (`costmodel predict --batch B`: B copies of one sequence's steady state) and for
this run (`costmodel predict --batch B --prompts B`: these B prompts decoded to their end, the
batch emptying as they finish, simulated call by call with the draws the decoder's forced
acceptance made), with their relative errors; the crossover batch where WFD stops beating DtV
on each side; and, per configuration, the median of measured over priced time of the decode's
block calls (how far the per-call prices are off). --measured FILE re-prices a previous --out
file's measurements (another profile) without measuring.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch

from costmodel.clitools import script_main
from costmodel.figures import batch_speedup_axes, save_figure
from costmodel.predict import predict
from costmodel.profile import load_profile
from costmodel.simulate import price_records
from costmodel.store import PROFILES_DIR
from costmodel.workload import Workload
from wfd.batch import Request, decode_batch
from wfd.checkpoint import load_model
from wfd.timing import Quiet


def requests_for(vocab: int, batch: int, context: int, new_tokens: int) -> list[Request]:
    return [Request(i, [(97 * j + 13 * i + 7) % vocab for j in range(context)], new_tokens)
            for i in range(batch)]


def measure(model, schedule: str, batch: int, args, hw=None, **kw) -> dict:
    """One batched run: its decode tokens/s, KV allocated, realized acceptance and, with ``hw``,
    the median over its decode block calls of measured over priced time."""
    run = decode_batch(model, requests_for(model.config.vocab_size, batch, args.context,
                                           args.new_tokens),
                       schedule=schedule, batch_size=batch, mode=args.mode, record=hw is not None,
                       force_acceptance=args.acceptance if schedule != "ar" else None, **kw)
    accepted = [r.acceptance for r in run.results if r.acceptance is not None]
    # priced in the order they ran: a call after another part's reads its weights from memory
    priced = [r.model_copy() for r in run.records]
    if hw is not None:
        price_records(model.config, hw, priced, dtype=args.dtype)
    measured = {"tokens_per_s": run.decode_tokens_per_s,
                "kv_bytes": run.stats["kv_bytes_allocated"],
                "acceptance": statistics.mean(accepted) if accepted else None,
                "block_call_ratio": None, "calls_ratio": None, "between_calls_fraction": None}
    if hw is None:
        return measured
    decode = [(m, p) for m, p in zip(run.records, priced, strict=True)
              if min(m.positions) >= args.context]
    calls_s = sum(m.wall_s for m, _ in decode)
    return {**measured,
            "block_call_ratio": statistics.median(m.wall_s / p.wall_s for m, p in decode
                                                  if m.kind == "block"),
            # the decode's calls (every part) over their price, and the decode's time outside
            # its calls: the host's work between them, which no call's price covers
            "calls_ratio": calls_s / sum(p.wall_s for _, p in decode),
            "between_calls_fraction": 1 - calls_s / (run.wall_s - run.prefill_s)}


def predicted(spec, hw, batch: int, args, acceptance: float | None, **kw):
    """The cost model's schedules for this batch (acceptance: the run's own)."""
    wl = Workload(context_length=args.context, new_tokens=args.new_tokens, batch_size=batch,
                  acceptance=acceptance if acceptance is not None else args.acceptance,
                  dtype=args.dtype)
    return predict(spec, hw, wl, **kw).schedules


def this_run(spec, hw, batch: int, args, dtv_labels: list[str], configs: dict
             ) -> dict[str, float]:
    """Decode tokens/s, per configuration, that `costmodel predict --batch B --prompts B`
    predicts for this run: the same prompts and (forced, seeded) draft outcomes, to the end of
    the last sequence. One prediction per DtV k; AR and WFD (at the same draft depth) from the
    first."""
    wl = Workload(context_length=args.context, new_tokens=args.new_tokens, batch_size=batch,
                  acceptance=args.acceptance, dtype=args.dtype, prompts=batch)
    runs = {label: predict(spec, hw, wl, **configs[label][1]).schedules for label in dtv_labels}
    first = runs[dtv_labels[0]]
    return {"ar": first["ar"].tokens_per_s, "wfd": first["wfd"].tokens_per_s,
            **{label: runs[label]["dtv"].tokens_per_s for label in dtv_labels}}


def check_kv(batch: int, label: str, run: dict, prediction) -> None:
    """The KV cache a run allocated must be the prediction's."""
    if run["kv_bytes"] != prediction.kv_bytes:
        raise SystemExit(f"B={batch} {label}: KV allocated {run['kv_bytes']} != predicted "
                         f"{prediction.kv_bytes}")


def crossover(rows: list[dict], side: str) -> int | None:
    """The smallest batch at which WFD's speedup falls below DtV's."""
    return next((r["batch"] for r in rows if r[f"{side}_wfd"] < r[f"{side}_dtv"]), None)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="huginn-small:random")
    ap.add_argument("--profile", default=None,
                    help="calibration profile (default: costmodel/data/profiles/"
                         "cpu-FAMILY-DTYPE.json, or on CUDA gpu-FAMILY-DTYPE.json: an eager "
                         "calibration of this GPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--block-lengths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--acceptance", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--retries", type=int, default=2,
                    help="times a run under load is run again (CPU; the fastest is kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda with --dtype bf16 and an "
                    "eager GPU profile (--profile)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--mode", default="eager", choices=("eager", "static"),
                    help="eager on every device: a batch's calls mix the sequences' slots in "
                         "ever new combinations, so graphs mode would capture a graph for each")
    ap.add_argument("--out", default=None)
    ap.add_argument("--figure", default=None)
    ap.add_argument("--measured", default=None,
                    help="a previous --out file: predict its measurements again (another "
                         "profile), without measuring")
    return ap.parse_args()


def saved_runs(args) -> tuple[dict, dict | None]:
    """A previous --out file's measurements and load report; ``args`` takes its settings."""
    with open(args.measured) as f:
        saved = json.load(f)
    for key in ("context", "new_tokens", "acceptance", "repeats"):
        if key in saved:  # repeats: saved since the load guard came in
            setattr(args, key, saved[key])
    args.batches = sorted({r["batch"] for r in saved["runs"]})
    args.block_lengths = sorted({int(r["label"][6:]) for r in saved["runs"]
                                 if r["label"].startswith("dtv k=")})
    return {(r["batch"], r["label"]): r["runs"] for r in saved["runs"]}, saved.get("load")


def measured_runs(model, hw, args, configs: dict) -> tuple[dict, dict]:
    """Every configuration at every batch, interleaved over the repeats, with the load guard."""
    measure(model, "ar", 1, argparse.Namespace(**{**vars(args), "new_tokens": 4}))  # warm-up
    # a GPU is not shared: a slow canary there is launch jitter, not load
    quiet = Quiet(args.device, retries=0 if args.device.startswith("cuda") else args.retries)
    runs: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.repeats):
        for batch in args.batches:
            for label, (schedule, kw) in configs.items():
                runs.setdefault((batch, label), []).append(quiet.measure(
                    lambda r: 1 / r["tokens_per_s"],
                    functools.partial(measure, model, schedule, batch, args, hw, **kw)))
                print(f"B={batch} {label}: {runs[batch, label][-1]['tokens_per_s']:.2f} "
                      "tokens/s", file=sys.stderr, flush=True)
    return runs, quiet.report()


def row_for(batch: int, runs: dict, spec, hw, args, configs: dict) -> dict:
    """One batch's measured speedups beside the predicted (full batch) and simulated (this run)
    ones, its KV allocated checked against the prediction's."""
    rate = {label: statistics.median(r["tokens_per_s"] for r in runs[batch, label])
            for label in configs}
    spread = {label: (min(r["tokens_per_s"] for r in runs[batch, label]),
                      max(r["tokens_per_s"] for r in runs[batch, label])) for label in configs}
    dtv_labels = [label for label in configs if label.startswith("dtv")]
    best = max(dtv_labels, key=rate.__getitem__)
    wfd_acc = runs[batch, "wfd"][0]["acceptance"]
    dtv_pred = {}
    for label in dtv_labels:
        k = configs[label][1]["block_length"]
        acc = runs[batch, label][0]["acceptance"]
        s = predicted(spec, hw, batch, args, acc, block_length=k)
        dtv_pred[label] = s["dtv"].tokens_per_s
        check_kv(batch, label, runs[batch, label][0], s["dtv"])
    s = predicted(spec, hw, batch, args, wfd_acc)
    for label in ("ar", "wfd"):
        check_kv(batch, label, runs[batch, label][0], s[label])
    pred_best = max(dtv_labels, key=dtv_pred.__getitem__)
    ar_pred = s["ar"].tokens_per_s
    sim = this_run(spec, hw, batch, args, dtv_labels, configs)
    sim_best = max(dtv_labels, key=sim.__getitem__)
    return {
        "batch": batch, "ar_tokens_per_s": rate["ar"], "ar_spread": spread["ar"],
        "ar_predicted_tokens_per_s": ar_pred,
        "dtv_best": best, "dtv_predicted_best": pred_best,
        "measured_dtv": rate[best] / rate["ar"], "predicted_dtv": dtv_pred[pred_best] / ar_pred,
        "measured_wfd": rate["wfd"] / rate["ar"],
        "predicted_wfd": s["wfd"].tokens_per_s / ar_pred,
        "simulated_dtv": sim[sim_best] / sim["ar"], "simulated_dtv_best": sim_best,
        "simulated_wfd": sim["wfd"] / sim["ar"], "simulated_ar_tokens_per_s": sim["ar"],
        "wfd_acceptance": wfd_acc, "dtv_acceptance": runs[batch, best][0]["acceptance"],
        "wfd_width": s["wfd"].width, "kv_bytes_checked": True,
        **{key: {label: statistics.median(r[key] for r in runs[batch, label])
                 for label in configs if runs[batch, label][0].get(key)}
           for key in ("block_call_ratio", "calls_ratio", "between_calls_fraction")},
        "rates": rate, "spreads": spread}


def print_speedups(rows: list[dict], args, profile, load: dict | None) -> None:
    ar1 = rows[0]["ar_tokens_per_s"]
    print(f"\n{args.model} ({args.dtype}, {args.threads} threads), context {args.context}, "
          f"{args.new_tokens} new tokens per sequence, forced acceptance {args.acceptance}, "
          f"medians of {args.repeats}; profile {profile.machine} {profile.created[:10]}")
    if load:
        print(f"Load: {load['retaken_fraction']:.0%} of runs taken again, "
              f"{load['loaded_fraction']:.0%} still over {load['canary_tolerance']}x when kept; "
              f"the kept runs' canary {load['canary_median']:.2f}x its fastest (median; "
              f"{load['canary_p10']:.2f}-{load['canary_p90']:.2f}x, 10th-90th percentile)")
    print()
    print("Speedups over AR at the same batch: measured; predicted by `costmodel predict --batch "
          "B` (a batch kept full) and for this run (`--prompts B`: the batch empties as its "
          "sequences finish).\n")
    print("| batch | AR tokens/s (range) | AR vs batch 1 | AR predicted: full / this run | "
          "DtV measured (k) | full batch (k) | this run (k) | WFD measured | full batch | "
          "this run |\n|---|---|---|---|---|---|---|---|---|---|")

    def err(value: float, measured: float) -> str:
        return f"{value:.2f}x ({value / measured - 1:+.0%})"

    for r in rows:
        lo, hi = r["ar_spread"]
        print(f"| {r['batch']} | {r['ar_tokens_per_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
              f"{r['ar_tokens_per_s'] / ar1:.2f}x | {r['ar_predicted_tokens_per_s']:.1f} / "
              f"{r['simulated_ar_tokens_per_s']:.1f} | "
              f"{r['measured_dtv']:.2f}x ({r['dtv_best'][6:]}) | "
              f"{err(r['predicted_dtv'], r['measured_dtv'])} ({r['dtv_predicted_best'][6:]}) | "
              f"{err(r['simulated_dtv'], r['measured_dtv'])} ({r['simulated_dtv_best'][6:]}) | "
              f"{r['measured_wfd']:.2f}x | {err(r['predicted_wfd'], r['measured_wfd'])} | "
              f"{err(r['simulated_wfd'], r['measured_wfd'])} |")


def print_call_ratios(rows: list[dict]) -> None:
    """How far the per-call prices are off: block calls, and every call with the time between."""
    if rows[0]["block_call_ratio"]:
        labels = list(rows[0]["block_call_ratio"])
        print("\nDecode block calls, measured over priced (median over each run's calls): how "
              "far the per-call prices are off at each batch\n")
        print("| batch | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
        for r in rows:
            print(f"| {r['batch']} | " + " | ".join(
                f"{r['block_call_ratio'][label]:.2f}" for label in labels) + " |")
    if rows[0]["calls_ratio"]:
        shown = ["ar", *sorted({r["dtv_best"] for r in rows}), "wfd"]
        print("\nThe decode's calls (every part), measured over priced, and its time between "
              "calls (the host's work, unpriced), median over repeats\n")
        print("| batch | " + " | ".join(f"{label}: calls / between" for label in shown)
              + " |\n|---|" + "---|" * len(shown))
        for r in rows:
            print(f"| {r['batch']} | " + " | ".join(
                f"{r['calls_ratio'][label]:.2f} / {r['between_calls_fraction'][label]:.1%}"
                for label in shown) + " |")


def draw_speedups(path: str, rows: list[dict], args, profile) -> None:
    def draw(fig) -> None:
        ax = fig.subplots()
        batches = [r["batch"] for r in rows]
        for i, name in enumerate(("dtv", "wfd")):
            ax.plot(batches, [r[f"measured_{name}"] for r in rows], marker="o",
                    color=f"C{i}", label=f"{name.upper()} measured")
            ax.plot(batches, [r[f"predicted_{name}"] for r in rows], linestyle="--",
                    marker="x", color=f"C{i}", label=f"{name.upper()} predicted, full batch")
            ax.plot(batches, [r[f"simulated_{name}"] for r in rows], linestyle=":",
                    marker="+", color=f"C{i}", label=f"{name.upper()} predicted, this run")
        batch_speedup_axes(ax, f"{args.model} {args.dtype} on {profile.machine}",
                           "decode speedup over AR at the same batch (x)")

    save_figure(path, draw, (7.5, 4.5))


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    spec, family = model.config, model.config.family
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    profile = load_profile(args.profile or PROFILES_DIR / f"{kind}-{family}-{args.dtype}.json")
    hw = profile.hardware
    if args.measured:  # price saved measurements with another profile
        runs, load = saved_runs(args)
    d = spec.default_draft_depth
    configs = {"ar": ("ar", {})}
    configs.update({f"dtv k={k}": ("dtv", {"block_length": k, "draft_depth": d})
                    for k in args.block_lengths})
    configs["wfd"] = ("wfd", {"draft_depth": d})
    if not args.measured:
        runs, load = measured_runs(model, hw, args, configs)

    rows = [row_for(batch, runs, spec, hw, args, configs) for batch in args.batches]
    print_speedups(rows, args, profile, load)
    print_call_ratios(rows)
    measured_x, predicted_x = crossover(rows, "measured"), crossover(rows, "predicted")
    simulated_x = crossover(rows, "simulated")
    print(f"\ncrossover (smallest batch where WFD < DtV): measured {measured_x}, predicted "
          f"{predicted_x} (full batch), {simulated_x} (this run); the KV cache allocated at "
          "every batch equals the prediction's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "context": args.context,
                       "new_tokens": args.new_tokens, "acceptance": args.acceptance,
                       "repeats": args.repeats,
                       "profile": str(args.profile), "rows": rows, "load": load,
                       "runs": [{"batch": b, "label": label, "runs": r}
                                for (b, label), r in runs.items()],
                       "crossover": {"measured": measured_x, "predicted": predicted_x,
                                     "simulated": simulated_x}},
                      f, indent=1)
    if args.figure:
        draw_speedups(args.figure, rows, args, profile)

if __name__ == "__main__":
    script_main(main)
