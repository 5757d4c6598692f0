"""How a projection's time grows with the rows (positions) in it on this CPU, for the paths the
decoder could take: F.linear on [out, in] weights, a matmul on weights stored transposed
([in, out], contiguous), bf16 weights, and 1 or 2 threads.

    python bench/matmul_paths.py [--shape 1024 2816 ...] [--rows 1 2 3 4 8 16 32] [--repeats 30]
        [--paths linear matmul bf16] [--cold]

With --cold each product reads one of enough copies of the weights to exceed the last-level
cache (as a large model's calls do); without it the same weights are reused (and stay cached).
Prints a Markdown table: milliseconds per product, the ratio to one row and the weights' GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from costmodel.clitools import script_main


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cold_copies(weight: torch.Tensor, total_bytes: float = 256e6) -> list[torch.Tensor]:
    count = max(2, int(total_bytes // (weight.numel() * weight.element_size())))
    return [weight.clone() for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, action="append",
                        help="in and out features, repeatable (default: 1024 2816, huginn-mid's "
                             "MLP up-projection)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--paths", nargs="+", default=["linear", "matmul", "bf16"],
                        choices=["linear", "matmul", "bf16"])
    parser.add_argument("--cold", action="store_true",
                        help="stream the weights from memory, not the cache")
    args = parser.parse_args()
    print("| weights | path | threads | rows | ms | x one row | GB/s of weights |\n"
          "|---|---|---|---|---|---|---|")
    for d_in, d_out in args.shape or [(1024, 2816)]:
        w = torch.randn(d_out, d_in) / d_in**0.5
        paths = {
            "linear": ("F.linear fp32 [out,in]", w, lambda x, w: F.linear(x, w), torch.float32),
            "matmul": ("matmul fp32 [in,out]", w.t().contiguous(), lambda x, w: x @ w,
                       torch.float32),
            "bf16": ("F.linear bf16 [out,in]", w.to(torch.bfloat16),
                     lambda x, w: F.linear(x, w), torch.bfloat16),
        }
        shape = f"{d_out}x{d_in} ({w.numel() * 4 / 1e6:.1f} MB fp32)"
        with torch.inference_mode():
            for threads in args.threads:
                torch.set_num_threads(threads)
                for key in args.paths:
                    label, weight, fn, dtype = paths[key]
                    weights = cold_copies(weight) if args.cold else [weight]
                    base = None
                    for rows in args.rows:
                        x = torch.randn(rows, d_in).to(dtype)

                        def run(x=x, fn=fn, weights=weights) -> None:
                            for each in weights:
                                fn(x, each)
                        t = timed(run, args.repeats) / len(weights)
                        base = base or t
                        gbs = weight.numel() * weight.element_size() / t / 1e9
                        print(f"| {shape} | {label} | {threads} | {rows} | {t * 1e3:.3f} | "
                              f"{t / base:.2f} | {gbs:.1f} |")


if __name__ == "__main__":
    script_main(main)
