"""Exits under load on the plugin's vLLM server: the same open-loop streams served at fixed
depth and with each exit rule, time to first token and per output token (p50, p99) and
throughput side by side.

    python bench/exit_load.py [--model huginn-tiny] [--rules kl:0.01] [--rates 4 8 16]
        [--requests 40] [--prompt-tokens 16-64] [--output-tokens 32] [--max-batch 8]
        [--repeats 2] [--seed 0] [--out F.json]

Each repeat starts a server per mode, one after another: fixed depth (vLLM's own forward), then
the plugin's exit mode with each rule as the engine's (``exit_rule``). Each is warmed up with a
request, then sent each rate's stream: the Poisson streams ``costmodel serving`` draws, sent as
``bench/serving_load.py`` sends them (greedy, each request on a thread of its own at its arrival
time, streamed and timed as its chunks arrive). Medians over the repeats; needs the serve-cpu
extra and a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_load import (  # noqa: E402
    load,
    send,
    served_folder,
    start_server,
    stream_lengths,
    stream_options,
    summarize_served,
)

from costmodel.clitools import script_main  # noqa: E402
from costmodel.requests import request_stream  # noqa: E402

FIGURES = (("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99"))


def serve_streams(folder: Path, mode: str, args, streams: dict[float, list]) -> dict:
    """{rate: the served stream's summary} from one server in ``mode`` ("fixed" or a rule)."""
    overrides = None if mode == "fixed" else {"exit_rule": mode}
    with tempfile.TemporaryDirectory() as tmp:
        server, base = start_server(folder, args.max_batch, overrides, Path(tmp) / "server.log")
        try:
            send(base, str(folder), [65] * 8, 4)  # warm the engine up
            return {rate: summarize_served(load(base, str(folder), stream, args.seed))
                    for rate, stream in streams.items()}
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_options(parser, [4.0, 8.0, 16.0])
    parser.add_argument("--rules", nargs="+", default=["kl:0.01"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompt, output = stream_lengths(args)
    streams = {rate: request_stream(rate, args.requests, prompt, output, seed=args.seed)
               for rate in args.rates}
    modes = ["fixed", *args.rules]
    passes: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        folder = served_folder(args.model, Path(tmp))
        for i in range(args.repeats):
            for mode in modes:
                print(f"pass {i + 1} of {args.repeats}: {mode}", file=sys.stderr, flush=True)
                passes[mode].append(serve_streams(folder, mode, args, streams))
    rows = [{"rate_per_s": rate, "mode": mode,
             **{f"{key}_{p}": statistics.median(run[rate][key][p] for run in passes[mode])
                for key, p in FIGURES},
             "tokens_per_s": statistics.median(run[rate]["throughput_tokens_per_s"]
                                               for run in passes[mode])}
            for rate in args.rates for mode in modes]
    print("| rate | mode | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | tokens/s |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate_per_s']:g}/s | `{r['mode']}` | "
              + " | ".join(f"{r[f'{key}_{p}'] * 1e3:.1f}" for key, p in FIGURES)
              + f" | {r['tokens_per_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    script_main(main)
