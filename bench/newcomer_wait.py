"""How long a request that reaches the plugin's vLLM server while another one decodes waits for
its first token, beside a lone request's: does the engine step under way end for it?

    python bench/newcomer_wait.py [--model huginn-tiny] [--schedule wfd] [--trials 24]
        [--prompt-tokens 40] [--running-tokens 160] [--seed 0]

Starts `vllm serve` (the plugin, eager, fp32) as bench/serving_load.py does and, for each
trial, times a lone request's first token, then starts a long request (``--running-tokens``)
and, 0.15-0.35 s into it, sends a newcomer and times its first token. Prints each one's median
and 90th percentile. A drafting schedule's wave commits tokens ahead of vLLM's sampler in long
steps when it runs alone; a newcomer waits for the step under way unless the wave hears of it
(``wfd.serving.hook.arrived``) and ends the step at its due readout. AR's steps are one token
long. Needs the serve-cpu extra.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from serving_load import send, served_folder, start_server

from costmodel.clitools import script_main


def first_token_ms(base: str, model: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    first, _, _ = send(base, model, prompt, 8)
    return (first - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="huginn-tiny")
    parser.add_argument("--schedule", default="wfd", choices=["ar", "dtv", "wfd"])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--running-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.trials < 1 or args.prompt_tokens < 1 or args.running_tokens < 1:
        raise SystemExit("error: --trials, --prompt-tokens and --running-tokens must be "
                         "at least 1")
    rng = np.random.default_rng(args.seed)

    def prompt() -> list[int]:  # a new one each time: no prefix cached
        return rng.integers(32, 127, args.prompt_tokens).tolist()

    overrides = None if args.schedule == "ar" else {"schedule": args.schedule}
    lone, beside = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = served_folder(args.model, Path(tmp))
        server, base = start_server(folder, 8, overrides, Path(tmp) / "server.log")
        model = str(folder)
        try:
            for _ in range(3):  # warm the engine up
                send(base, model, prompt(), 16)
            for _ in range(args.trials):
                lone.append(first_token_ms(base, model, prompt()))
                running = threading.Thread(target=send, args=(base, model, prompt(),
                                                               args.running_tokens))
                running.start()
                time.sleep(0.15 + 0.2 * rng.random())
                beside.append(first_token_ms(base, model, prompt()))
                running.join()
        finally:
            server.terminate()
            server.wait(timeout=60)
    for name, times in (("lone", lone), ("beside a running request", beside)):
        print(f"{args.schedule} {name}: TTFT median {np.median(times):.1f} ms, "
              f"90th percentile {np.percentile(times, 90):.1f} ms ({len(times)} requests)")


if __name__ == "__main__":
    script_main(main)
