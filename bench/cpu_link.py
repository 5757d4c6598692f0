"""The link between tensor-parallel ranks on this CPU, as vLLM's CPU build joins them: the time
of one all-reduce against its size, fitted to the cost model's line (costmodel.parallel):

    t = latency + 2 (T - 1) / T * bytes / bandwidth

    python bench/cpu_link.py [--ranks 2] [--repeats 200] [--json]

Starts ``--ranks`` processes (one thread each, as vLLM's CPU workers split the cores), joins
them with vLLM's own distributed setup (its shared-memory all-reduce where the build has it,
else torch.distributed's gloo), and times ``tensor_model_parallel_all_reduce`` of fp32 hidden
states from one row of 128 up to 64 rows of 4096: the median over the repeats per size, then a
least-squares line. Prints the sizes' times, the fitted latency and bandwidth, and the link's
entry for costmodel/data/links.json. Needs the serve-cpu extra.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import numpy as np

SIZES_BYTES = [512, 4096, 32768, 131072, 524288, 1048576]


def rank_times(rank: int, ranks: int, port: int, repeats: int, queue) -> None:
    """One rank: vLLM's tensor-parallel group, then each size's all-reduces timed."""
    import torch

    torch.set_num_threads(1)
    import vllm._custom_ops  # noqa: F401 - registers the shared-memory all-reduce vLLM uses
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        tensor_model_parallel_all_reduce,
    )

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(ranks, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(ranks)
        times = {}
        for size in SIZES_BYTES:
            x = torch.ones(size // 4)
            for _ in range(20):
                tensor_model_parallel_all_reduce(x)
            took = []
            for _ in range(repeats):
                start = time.perf_counter()
                tensor_model_parallel_all_reduce(x)
                took.append(time.perf_counter() - start)
            times[size] = statistics.median(took)
        if rank == 0:
            queue.put(times)


def fit(times: dict[int, float], ranks: int) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) of the line through the sizes' times."""
    sizes = np.array(sorted(times), dtype=float)
    slope, latency = np.polyfit(sizes, [times[int(s)] for s in sizes], 1)
    if slope <= 0:
        raise SystemExit("cpu_link: the times do not grow with the size (a busy machine?): "
                         "run it again with more --repeats")
    return max(float(latency), 0.0), 2 * (ranks - 1) / ranks / float(slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.ranks < 2:
        raise SystemExit("cpu_link: --ranks must be at least 2")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("VLLM_DIST_IDENT", f"cpu-link-{port}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=rank_times, args=(r, args.ranks, port, args.repeats,
                                                        queue)) for r in range(args.ranks)]
    for worker in workers:
        worker.start()
    times = queue.get(timeout=600)
    for worker in workers:
        worker.join(timeout=60)
    latency, bandwidth = fit(times, args.ranks)
    entry = {"bandwidth_bytes_per_s": float(f"{bandwidth:.3g}"),
             "latency_s": float(f"{latency:.3g}")}
    if args.json:
        print(json.dumps({"ranks": args.ranks, "times_s": times, "link": entry}))
        return
    for size, t in sorted(times.items()):
        print(f"{size:>9} bytes  {t * 1e6:8.1f} us")
    print(f"latency {latency * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"({args.ranks} ranks)")
    print(json.dumps(entry))


if __name__ == "__main__":
    main()
