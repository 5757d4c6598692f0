"""Open-loop load on the plugin's vLLM server, beside `costmodel serving`'s simulation of the
same streams: are the simulated latencies the served ones?

    python bench/serving_load.py --profile PROFILE.json [--model huginn-tiny] [--rates 2 4 8]
        [--requests 40] [--prompt-tokens 16-64] [--output-tokens 32] [--max-batch 8]
        [--schedule ar] [--commit-ahead 8] [--exit RULE] [--fidelity steps|calls]
        [--token-budget 2048] [--seed 0] [--together 1 2 3 4 8] [--fit-each] [--out FILE.json]
    python bench/serving_load.py --profile PROFILE.json --resimulate FILE.json

Starts `vllm serve` (the plugin, eager, fp32) on a copy of the shipped tiny model with its byte
tokenizer, and for each rate sends the stream `costmodel serving` draws for it (Poisson
arrivals, the same seed, random printable prompts of the drawn lengths) open-loop: each request
at its arrival time on a thread of its own, streamed (`/v1/completions`, greedy, ignore_eos),
its first and last chunks timed as they arrive. TTFT is arrival to the first chunk (the
prefill's token), TPOT the rest over the tokens after the first. The same streams are then
simulated (`costmodel.serving`, `--engine vllm`) with the profile's hardware, step by step as
vLLM schedules (the server's token budget, 2,048 on the CPU build), or call by call with
`--fidelity calls`, and the medians, p99s and throughput printed side by side (a p99 of fewer
than 100 requests is about their slowest one; `--out` keeps each request's times).

The engine's own time, which the per-call cost does not hold, is measured first and apart from
the streams, six times each from lone requests of the mean lengths, two arriving together and
a full batch arriving together (`engine_measurements`), and given to the simulations: AR's
per step and per sequence in a step, a drafting schedule's per tick and per wave in a tick (the
plugin's waves do their bookkeeping a tick at a time) and vLLM's per step, which the pair and
lone requests whose waves commit nothing ahead tell apart (a lone wave's step commits up to 9
tokens; one beside another request's, or committing nothing ahead, far fewer); and the lone
requests' TTFT split by vLLM's own account of them on /metrics (queued and prefilling) into its
time on a prompt's step, busy, and per request on its way in and out, not (`engine_fit.py`;
`costmodel serving --step-overhead --sequence-overhead --tick-overhead --wave-overhead
--prompt-overhead --request-overhead`); so is its wake, the extra time of a request that
finds the server idle (`wake_after_idle`: lone requests after 0.1-2 s idle;
`--wake-overhead`), which is what makes the tail of TTFT at low rates. `--together N ...`
then serves N requests of the mean lengths arriving together, three times each, and prints
their median TPOT beside the simulated: the engine's time per token as the requests it serves
grow, which the streams mix. `--fit-each` measures and fits the engine's own time again right
before each stream (each row of `--out` keeps the measurements its simulation was fitted to).
`--exit RULE` serves with the plugin's exit mode, the streams simulated with the exit depths
wfd's AR with the rule gives the first stream's prompts (fitted as the waves' engine time).
`--resimulate` simulates an earlier run's `--out` file again with no server: a change to the
cost model compared on the same measurements. Needs the serve-cpu extra. A profile of this
machine: `costmodel calibrate --model huginn --quick`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from engine_fit import (
    engine_measurements,
    engine_text,
    fit_engine,
    lone_request,
    median_tpot,
    served_together,
    simulated_together,
    wake_after_idle,
)

from costmodel.clitools import script_main
from costmodel.engines import EngineOverheads, for_engine
from costmodel.presets import get_model
from costmodel.profile import load_profile
from costmodel.requests import Lengths, Request, request_stream
from costmodel.serving import Served, predict_serving, summarize

ROOT = Path(__file__).resolve().parents[1]


def start_server(folder: Path, max_batch: int, overrides: dict | None, log: Path
                 ) -> tuple[subprocess.Popen, str]:
    """`vllm serve` on ``folder``, up and answering (its base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    extra = ["--hf-overrides", json.dumps(overrides)] if overrides else []
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "512", "--max-num-seqs", str(max_batch),
         *extra],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"error: the server stopped:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return server, base
        except OSError:
            time.sleep(1)
    server.terminate()
    sys.exit("error: the server did not come up in 300 s")


def send(base: str, model: str, prompt: list[int], tokens: int, extra: dict | None = None
         ) -> tuple[float, float, int]:
    """One streamed request (``extra``: its extra arguments for the plugin, vLLM's
    ``vllm_xargs``): (first chunk's time, last chunk's time, tokens received)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True, **({"vllm_xargs": extra} if extra else {})
                       }).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    first = last = None
    received = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = now
            if ids:
                received, last = received + len(ids), now
    return first, last, received


def engine_clock(base: str) -> tuple[float, int]:
    """vLLM's own account of the requests it finished, from the server's /metrics: their
    seconds waiting in its queue and prefilling (scheduled to first token), summed, and their
    number; the rest of a TTFT is the request's way in and its first token's out."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()

    def value(name: str) -> float:
        return sum(float(line.split()[-1]) for line in lines
                   if line.startswith(name + "{") or line.startswith(name + " "))

    seconds = sum(value(f"vllm:request_{part}_time_seconds_sum") for part in ("queue", "prefill"))
    return seconds, round(value("vllm:request_prefill_time_seconds_count"))


def stream_prompts(requests, seed: int) -> list[list[int]]:
    """The prompts a stream's requests send: random printable bytes of their lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(32, 127, r.prompt_tokens).tolist() for r in requests]


def load(base: str, model: str, requests, seed: int, extra: dict | None = None
         ) -> list[Served]:
    """The stream sent open-loop: each request on its own thread at its arrival time."""
    prompts = stream_prompts(requests, seed)
    results: list[tuple[float, float, int] | None] = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = send(base, model, prompts[i], requests[i].output_tokens, extra)

    start = time.perf_counter()
    threads = []
    for i, r in enumerate(requests):
        time.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    served = []
    for r, (first, last, received) in zip(requests, results, strict=True):
        if received != r.output_tokens:
            sys.exit(f"error: a request asked for {r.output_tokens} tokens and got {received}")
        served.append(Served(arrival_s=r.arrival_s, first_token_s=first - start,
                             finish_s=last - start, output_tokens=r.output_tokens))
    return served


def wake_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-wake", dest="wake", action="store_false",
                        help="leave out the engine's wake from idle (measured by default: "
                             "lone requests after 0.1-2 s idle, about 30 s)")


def stream_arguments(parser: argparse.ArgumentParser, rates: list[float]) -> None:
    """A load bench's options: the profile, the model and schedule, and the streams'."""
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--schedule", default="ar", choices=["ar", "wfd", "dtv"])
    stream_options(parser, rates)


def stream_options(parser: argparse.ArgumentParser, rates: list[float]) -> None:
    """The model, the streams sent to it and where the results go."""
    parser.add_argument("--model", default="huginn-tiny")
    parser.add_argument("--rates", type=float, nargs="+", default=rates)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", default="16-64")
    parser.add_argument("--output-tokens", default="32")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)


def served_folder(model: str, parent: Path) -> Path:
    """A copy of a shipped model in ``parent`` with a tokenizer file of its byte vocabulary,
    for the server to take text."""
    from wfd.tokenizer import write_byte_tokenizer

    folder = parent / model
    folder.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "wfd" / "models" / model / file, folder)
    write_byte_tokenizer(folder, max_length=512)
    return folder


def stream_lengths(args) -> tuple[Lengths, Lengths]:
    return (Lengths.parse(args.prompt_tokens, "--prompt-tokens"),
            Lengths.parse(args.output_tokens, "--output-tokens"))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser, [2.0, 4.0, 8.0])
    parser.add_argument("--commit-ahead", type=int, default=8)
    parser.add_argument("--exit", dest="exit_rule", metavar="RULE",
                        help="serve with this exit rule (the plugin's exit mode)")
    parser.add_argument("--fidelity", choices=["steps", "calls"], default="steps",
                        help="simulate step by step as vLLM schedules (default), or call by "
                             "call")
    wake_option(parser)
    parser.add_argument("--token-budget", type=int, default=2048,
                        help="the tokens a step of the server's takes (its "
                             "max_num_batched_tokens; the CPU build's default: 2048)")
    parser.add_argument("--together", type=int, nargs="*", default=[], metavar="N",
                        help="before the streams, N requests of the mean lengths arriving "
                             "together (three times each), their median TPOT measured and "
                             "simulated: how the time per token grows with the requests served")
    parser.add_argument("--fit-each", action="store_true",
                        help="measure and fit the engine's own time again right before each "
                             "stream, not once before the first (is an error the machine's "
                             "speed drifting over minutes?)")
    parser.add_argument("--resimulate", type=Path, metavar="RUN.json",
                        help="no server: simulate again the streams of an earlier run's --out "
                             "file beside its measurements (after a change to the cost model)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.resimulate:
        return resimulate(saved_run(args.resimulate), args)
    prompt, output = stream_lengths(args)
    spec = get_model(args.model)
    profile = load_profile(args.profile)
    hw = for_engine("vllm", profile.hardware, spec)
    if args.exit_rule:  # the depths wfd's AR with the rule stops the first stream's tokens at
        from tiny_models import exit_distribution
        first = request_stream(args.rates[0], args.requests, prompt, output, seed=args.seed)
        args.exit_depths = exit_distribution(args.model, args.exit_rule,
                                             stream_prompts(first, args.seed),
                                             [r.output_tokens for r in first])
    options = simulation_options(args, profile.dtype)
    run = served_run(args, spec, hw, options, prompt, output)
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "schedule": args.schedule, "profile": str(args.profile),
            "exit_rule": args.exit_rule, "exit_depths": getattr(args, "exit_depths", None),
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "max_batch": args.max_batch, "commit_ahead": args.commit_ahead,
            "fidelity": args.fidelity, "token_budget": args.token_budget, "seed": args.seed,
            **run}, indent=2))


def served_run(args, spec, hw, options: dict, prompt: Lengths, output: Lengths) -> dict:
    """On a server of the plugin: the engine's own time measured and fitted (and its wake),
    the requests served together (``--together``), and each rate's stream served and
    simulated (the engine measured again before each stream with ``--fit-each``)."""
    overrides = {**({} if args.schedule == "ar" else {"schedule": args.schedule,
                                                      "commit_ahead": args.commit_ahead}),
                 **({"exit_rule": args.exit_rule} if args.exit_rule else {})} or None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = served_folder(args.model, Path(tmp))
        server, base = start_server(folder, args.max_batch, overrides, Path(tmp) / "server.log")
        try:
            send(base, str(folder), [65] * 8, 4)  # warm the engine up

            def serve(requests, seed, extra=None):
                return load(base, str(folder), requests, seed, extra)

            def engine_now(wake=()) -> tuple[dict, EngineOverheads]:
                measured = engine_measurements(serve, prompt, output, args.max_batch, repeats=6,
                                               step_by_step=bool(overrides),
                                               engine_clock=lambda: engine_clock(base))
                return measured, fit_engine(measured, spec, hw, prompt, output, options,
                                            args.commit_ahead).model_copy(update={"wake": wake})
            fit, engine = engine_now()
            if args.wake:
                engine = engine.model_copy(update={
                    "wake": wake_after_idle(lone_request(prompt, output, serve))})
            print(engine_text(engine), flush=True)
            together = [together_row(  # three times each, other prompts than the fit's
                n, median_tpot(served_together(serve, prompt, output, n, range(2000, 2003))),
                spec, hw, engine, options, prompt, output) for n in args.together]
            measured, now = fit, engine
            for rate in args.rates:
                if rows and args.fit_each:  # measured again, right before this stream
                    measured, now = engine_now(engine.wake)
                    print(engine_text(now), flush=True)
                stream = request_stream(rate, args.requests, prompt, output, seed=args.seed)
                rows.append({**simulated_row(rate, stream, serve(stream, args.seed), spec, hw,
                                             now, options), "engine_measured": measured})
        finally:
            server.terminate()
            server.wait(timeout=60)
    return {"engine_measured": fit, "engine": engine.model_dump(), "together": together,
            "rows": rows}


def simulation_options(args, dtype: str) -> dict:
    exits = getattr(args, "exit_depths", None)
    return {"max_batch": args.max_batch, "dtype": dtype, "names": [args.schedule],
            "seed": args.seed, "fidelity": args.fidelity,
            "token_budget": args.token_budget if args.fidelity == "steps" else None,
            **({"exits": {"exit_depths": exits}, "continuous_depth": True} if exits else {})}


def simulated_row(rate: float, stream: list[Request], served: list[Served], spec, hw,
                  engine: EngineOverheads, options: dict) -> dict:
    """A rate's stream as served and as simulated, side by side (its line printed)."""
    measured = summarize_served(served)
    simulated = predict_serving(spec, hw, stream, engine=engine, keep_served=True,
                                **options)[options["names"][0]]
    row = {"rate_per_s": rate, "measured": measured,
           "simulated": simulated.model_dump(mode="json"),
           "requests": side_by_side(stream, served, simulated.served)}
    print(line(rate, measured, row["simulated"]), flush=True)
    return row


def together_row(n: int, measured_tpot_s: float, spec, hw, engine: EngineOverheads,
                 options: dict, prompt: Lengths, output: Lengths) -> dict:
    """``n`` requests arriving together: their median TPOT as measured and as simulated (its
    line printed)."""
    simulated = simulated_together(spec, hw, engine, options, prompt, output, n)[0]
    print(f"{n} together: TPOT p50 {measured_tpot_s * 1e3:6.2f} vs {simulated * 1e3:6.2f} ms "
          "(measured vs simulated)", flush=True)
    return {"requests": n, "tpot_s": [measured_tpot_s, simulated]}


RUN_FIELDS = ("model", "schedule", "max_batch", "prompt_tokens", "output_tokens", "commit_ahead",
              "engine_measured", "engine", "rows")


def saved_run(path: Path) -> dict:
    """A run's --out file, with what ``resimulate`` needs (a ValueError in one line if not)."""
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a run's --out file: {exc.msg} at line {exc.lineno}"
                         ) from None
    missing = [field for field in RUN_FIELDS if field not in run] if isinstance(run, dict) \
        else list(RUN_FIELDS)
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: only a run of this bench's "
                         "version keeps what simulating it again needs; run it again")
    return run


def resimulate(run: dict, args) -> None:
    """An earlier run's streams (``run``: its --out file) simulated again with this tree's cost
    model and ``args.profile``, the engine's own time fitted again to the measurements the run
    kept (each stream's own, where it measured the engine again before it), its wake as
    measured."""
    args.model, args.schedule, args.max_batch = run["model"], run["schedule"], run["max_batch"]
    args.prompt_tokens, args.output_tokens = run["prompt_tokens"], run["output_tokens"]
    for setting in ("fidelity", "token_budget", "seed"):  # as the run simulated it
        setattr(args, setting, run.get(setting, getattr(args, setting)))
    args.exit_depths = {int(d): p for d, p in (run.get("exit_depths") or {}).items()} or None
    prompt, output = stream_lengths(args)
    spec = get_model(args.model)
    profile = load_profile(args.profile)
    hw = for_engine("vllm", profile.hardware, spec)
    options = simulation_options(args, profile.dtype)
    wake = EngineOverheads.model_validate({"wake": run["engine"]["wake"]}).wake

    def fitted(measured: dict) -> EngineOverheads:
        return fit_engine(measured, spec, hw, prompt, output, options, run["commit_ahead"]
                          ).model_copy(update={"wake": wake})

    engine = fitted(run["engine_measured"])
    print(engine_text(engine), flush=True)
    together = [together_row(row["requests"], row["tpot_s"][0], spec, hw, engine, options,
                             prompt, output) for row in run.get("together", [])]
    rows = []
    for row in run["rows"]:
        stream = [Request(arrival_s=r["arrival_s"], prompt_tokens=r["prompt_tokens"],
                          output_tokens=r["output_tokens"]) for r in row["requests"]]
        served = [Served(arrival_s=r["arrival_s"], first_token_s=r["arrival_s"] + r["ttft_s"][0],
                         finish_s=r["arrival_s"] + r["ttft_s"][0]
                         + r["tpot_s"][0] * (r["output_tokens"] - 1),
                         output_tokens=r["output_tokens"]) for r in row["requests"]]
        measured = row.get("engine_measured", run["engine_measured"])
        now = engine if measured == run["engine_measured"] else fitted(measured)
        if now is not engine:
            print(engine_text(now), flush=True)
        rows.append({**simulated_row(row["rate_per_s"], stream, served, spec, hw, now, options),
                     "engine_measured": measured})
    if args.out:
        args.out.write_text(json.dumps({**run, "profile": str(args.profile),
                                        "engine": engine.model_dump(), "together": together,
                                        "rows": rows}, indent=2))


def side_by_side(stream: list[Request], measured: list[Served], simulated: list[Served]
                 ) -> list[dict]:
    """Each request's arrival and lengths, and its TTFT and TPOT as measured and as simulated
    (seconds): which requests make a tail, and whether the simulation has them too."""
    return [{"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "ttft_s": [m.ttft_s, s.ttft_s],
             "tpot_s": [m.tpot_s, s.tpot_s]}
            for r, m, s in zip(stream, measured, simulated, strict=True)]


def summarize_served(served: list[Served]) -> dict:
    from costmodel.schedules import AR

    return summarize(AR(), served, mean_batch=0.0).model_dump(
        mode="json", include={"ttft_s", "tpot_s", "e2e_s", "throughput_tokens_per_s"})


def line(rate: float, measured: dict, simulated: dict) -> str:
    def ms(d: dict, key: str, p: str) -> str:
        return f"{d[key][p] * 1e3:7.1f}"
    return (f"rate {rate:5.2f}/s  TTFT p50 {ms(measured, 'ttft_s', 'p50')} vs "
            f"{ms(simulated, 'ttft_s', 'p50')} ms  p99 {ms(measured, 'ttft_s', 'p99')} vs "
            f"{ms(simulated, 'ttft_s', 'p99')}  TPOT p50 {ms(measured, 'tpot_s', 'p50')} vs "
            f"{ms(simulated, 'tpot_s', 'p50')} ms  p99 {ms(measured, 'tpot_s', 'p99')} vs "
            f"{ms(simulated, 'tpot_s', 'p99')}  tokens/s "
            f"{measured['throughput_tokens_per_s']:7.1f} vs "
            f"{simulated['throughput_tokens_per_s']:7.1f}  (measured vs simulated)")


if __name__ == "__main__":
    script_main(main)
