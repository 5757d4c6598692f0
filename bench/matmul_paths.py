"""How a projection's time grows with the rows (positions) in it on this CPU, for the paths the
decoder could take: F.linear on [out, in] weights, a matmul on weights stored transposed
([in, out], contiguous), bf16 weights, and 1 or 2 threads.

    python bench/matmul_paths.py [--shape 1024 2816] [--rows 1 2 3 4 8 16 32] [--repeats 30]

Prints a Markdown table: milliseconds per product and the ratio to one row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[1024, 2816],
                        help="in and out features (default: huginn-mid's MLP up-projection)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    d_in, d_out = args.shape
    w = torch.randn(d_out, d_in) / d_in**0.5
    paths = {
        "F.linear fp32 [out,in]": (w, lambda x, w: F.linear(x, w), torch.float32),
        "matmul fp32 [in,out]": (w.t().contiguous(), lambda x, w: x @ w, torch.float32),
        "F.linear bf16 [out,in]": (w.to(torch.bfloat16), lambda x, w: F.linear(x, w),
                                   torch.bfloat16),
    }
    mb = w.numel() * 4 / 1e6
    print(f"weights {d_out}x{d_in} ({mb:.1f} MB fp32)\n")
    print("| path | threads | rows | ms | x one row | GB/s of weights |\n|---|---|---|---|---|---|")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for label, (weight, fn, dtype) in paths.items():
                base = None
                for rows in args.rows:
                    x = torch.randn(rows, d_in).to(dtype)
                    t = timed(lambda x=x, weight=weight, fn=fn: fn(x, weight), args.repeats)
                    base = base or t
                    gbs = weight.numel() * weight.element_size() / t / 1e9
                    print(f"| {label} | {threads} | {rows} | {t * 1e3:.3f} | {t / base:.2f} | "
                          f"{gbs:.1f} |")


if __name__ == "__main__":
    main()
