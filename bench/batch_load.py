"""Open-loop load on `wfd`'s batch path (continuous batching in one process), beside `costmodel
serving`'s simulation of the same streams: are the simulated latencies the decoder's?

    python bench/batch_load.py --profile PROFILE.json [--model huginn-tiny] [--schedule ar]
        [--rates 2 8 32] [--requests 40] [--prompt-tokens 16-64] [--output-tokens 32]
        [--max-batch 8] [--seed 0] [--out FILE.json]

For each rate, the stream `costmodel serving` draws (Poisson arrivals, the seed, the lengths)
is decoded by ``wfd.batch.decode_batch`` with each request admitted once its arrival time has
passed on the wall clock (``arrivals``), greedy, random prompts of the drawn lengths. TTFT is
arrival to the first token, TPOT the rest over the tokens after the first. The same stream is
then simulated call by call with the profile's hardware (a calibration of this decoder), the
drafting schedules at the acceptance the run measured, and the medians, p99s and throughput
printed side by side. The batch path's own time beside its calls (merging the sequences'
inputs, splitting the outputs, each plan's bookkeeping), which a calibration at batch 1 does
not hold, is fitted first and apart from the streams, as bench/serving_load.py fits vLLM's:
lone requests of the mean lengths, two and then a full batch of them arriving together; and its
wake from idle (lone requests arriving after 0.1-2 s asleep, the decoder sleeping until
they arrive, as in a stream; `--no-wake` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from engine_fit import engine_overheads, engine_text, lone_request, wake_after_idle
from serving_load import side_by_side, stream_arguments, stream_lengths, wake_option

from costmodel.clitools import script_main
from costmodel.presets import get_model
from costmodel.profile import load_profile
from costmodel.requests import request_stream
from costmodel.schedules import AR
from costmodel.serving import Served, predict_serving, summarize


def decoded(model, stream, schedule: str, max_batch: int, seed: int) -> tuple[list, float]:
    """Each request of ``stream`` as the decoder served it, and the acceptance it measured."""
    from wfd.batch import Request, decode_batch

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    requests = [Request(i, rng.integers(32, min(127, vocab), r.prompt_tokens).tolist(),
                        r.output_tokens) for i, r in enumerate(stream)]
    run = decode_batch(model, requests, schedule=schedule, batch_size=max_batch,
                       arrivals=[r.arrival_s for r in stream])
    served = []
    for result in sorted(run.results, key=lambda r: r.index):
        arrival = stream[result.index].arrival_s
        first = result.admitted_s + result.time_to_first_token_s
        served.append(Served(arrival_s=arrival, first_token_s=first,
                             finish_s=result.admitted_s + result.wall_s,
                             output_tokens=len(result.tokens)))
    accepted = [r.acceptance for r in run.results if r.acceptance is not None]
    return served, statistics.mean(accepted) if accepted else None


def figures(result) -> dict:
    return {"ttft_p50_s": result.ttft_s.p50, "ttft_p99_s": result.ttft_s.p99,
            "tpot_p50_s": result.tpot_s.p50, "tpot_p99_s": result.tpot_s.p99,
            "tokens_per_s": result.throughput_tokens_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stream_arguments(parser, [2.0, 8.0, 32.0])
    wake_option(parser)
    args = parser.parse_args()
    from wfd.checkpoint import load_model

    prompt, output = stream_lengths(args)
    profile = load_profile(args.profile)
    spec, model = get_model(args.model), load_model(args.model)
    decoded(model, request_stream(100.0, 4, prompt, output, seed=1), args.schedule,
            args.max_batch, args.seed)  # warm-up
    options = {"max_batch": args.max_batch, "dtype": profile.dtype, "names": [args.schedule],
               "seed": args.seed}

    def served(requests, seed: int) -> list:  # the requests as the batch path served them
        return decoded(model, requests, args.schedule, args.max_batch, seed)[0]

    engine = engine_overheads(
        served, spec, profile.hardware, prompt, output, options, commit_ahead=0,
        in_process=True, repeats=6)  # a few seconds: the fit's figures move with the machine
    if args.wake:
        engine = engine.model_copy(update={
            "wake": wake_after_idle(lone_request(prompt, output, served))})
    print(engine_text(engine, "the batch path's"), flush=True)
    rows = []
    for rate in args.rates:
        stream = request_stream(rate, args.requests, prompt, output, seed=args.seed)
        served, acceptance = decoded(model, stream, args.schedule, args.max_batch, args.seed)
        measured = summarize(AR(), served, mean_batch=0.0)
        simulated = predict_serving(spec, profile.hardware, stream, engine=engine,
                                    acceptance=acceptance, keep_served=True,
                                    **options)[args.schedule]
        rows.append({"rate_per_s": rate, "acceptance": acceptance,
                     "measured": figures(measured), "simulated": figures(simulated),
                     "requests": side_by_side(stream, served, simulated.served)})
        m, s = rows[-1]["measured"], rows[-1]["simulated"]
        print(f"rate {rate:5.1f}/s  TTFT p50 {m['ttft_p50_s'] * 1e3:6.1f} vs "
              f"{s['ttft_p50_s'] * 1e3:6.1f} ms  p99 {m['ttft_p99_s'] * 1e3:6.1f} vs "
              f"{s['ttft_p99_s'] * 1e3:6.1f}  TPOT p50 {m['tpot_p50_s'] * 1e3:5.2f} vs "
              f"{s['tpot_p50_s'] * 1e3:5.2f} ms  p99 {m['tpot_p99_s'] * 1e3:5.2f} vs "
              f"{s['tpot_p99_s'] * 1e3:5.2f}  tokens/s {m['tokens_per_s']:6.1f} vs "
              f"{s['tokens_per_s']:6.1f}  (measured vs simulated)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "schedule": args.schedule,
                                        "profile": str(args.profile), "rows": rows}, indent=2))


if __name__ == "__main__":
    script_main(main)
