"""A device's first half minute: what the decoder will run on it, before anything is measured.

    python calibrate/gpu_smoke.py [--device cuda] [--dtype bf16] [--modes eager static graphs]
        [--json FILE]

Prints the torch, CUDA and cuDNN versions; the attention kernel the decoder's policy lets
scaled-dot-product attention choose (wfd.layers.allowed_backends) for the real models' head
shapes (Huginn-3.5B, Ouro-2.6B) at three static spans, beside PyTorch's unrestricted choice;
eager attention timed over a growing key length (as an eager decode grows it, one key per call)
with each candidate kernel forced, so a kernel that builds a plan per key length shows as a slow
first call per length; and the shipped tiny models decoded in each mode, their readouts at every
depth against a full forward without a cache. On a CPU it runs eager and static (graphs needs
CUDA); the tests run it so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout: the repository on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from costmodel.presets import MODELS
from costmodel.slots import STATIC_SPAN_KEYS
from costmodel.trace import atomic_write
from wfd.checkpoint import DTYPES, load_model
from wfd.generate import full_forward, generate
from wfd.layers import BACKEND_NAMES, SDPBackend, backend_for, sdpa_kernel

REAL_MODELS = ("huginn-3.5b", "ouro-2.6b")
SPANS = (STATIC_SPAN_KEYS, 5 * STATIC_SPAN_KEYS, 16 * STATIC_SPAN_KEYS)
CANDIDATES = ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")
QUERIES = {"one query per key set (AR, a WFD wave)": 1, "5 queries per key set (DtV k=4)": 5}


def versions(device: torch.device) -> dict[str, object]:
    out: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cuda": torch.version.cuda,
                              "cudnn": torch.backends.cudnn.version()
                              if torch.backends.cudnn.is_available() else None}
    if device.type == "cuda":
        out["device"] = torch.cuda.get_device_name(device)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is not None and SDPBackend is not None:
        out["sdp_priority_order"] = [BACKEND_NAMES.get(SDPBackend(b).name, str(b))
                                     for b in order()]
    return out


def shapes(model: str, per_group: int, span: int, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and the additive mask of one group of a call, as wfd.layers.attend
    shapes them: [1, heads, queries, head_dim], [1, kv_heads, span, head_dim]."""
    spec = MODELS[model]
    q = torch.randn(1, spec.num_heads, per_group, spec.head_dim, dtype=dtype, device=device)
    k = torch.randn(1, spec.num_kv_heads, span, spec.head_dim, dtype=dtype, device=device)
    return q, k, torch.zeros(1, 1, per_group, span, dtype=dtype, device=device)


def unrestricted(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> str:
    """PyTorch's own choice, every candidate kernel allowed."""
    if SDPBackend is None:
        return "unknown"
    return backend_for(q, k, mask, [getattr(SDPBackend, name) for name in CANDIDATES])


def chosen(dtype: torch.dtype, device: torch.device) -> list[dict]:
    rows = []
    for model in REAL_MODELS:
        for label, per_group in QUERIES.items():
            for span in SPANS:
                q, k, mask = shapes(model, per_group, span, dtype, device)
                rows.append({"model": model, "queries": label, "span": span,
                             "decoder": backend_for(q, k, mask),
                             "unrestricted": unrestricted(q, k, mask)})
    return rows


def timed_growing_keys(dtype: torch.dtype, device: torch.device, start: int = 1024,
                       steps: int = 24) -> list[dict]:
    """Eager attention of one query over ``start``..``start + steps`` keys, one more each call,
    with each kernel forced: the first call's time and the median of the rest, per kernel."""
    rows = []
    for model in REAL_MODELS:
        spec = MODELS[model]
        q = torch.randn(1, spec.num_heads, 1, spec.head_dim, dtype=dtype, device=device)
        keys = torch.randn(1, spec.num_kv_heads, start + steps, spec.head_dim, dtype=dtype,
                           device=device)
        mask = torch.zeros(1, 1, 1, start + steps, dtype=dtype, device=device)
        for name in CANDIDATES if SDPBackend is not None else []:
            times, error = [], None
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    for n in range(start, start + steps):
                        k = keys[:, :, :n]
                        t0 = time.perf_counter()
                        F.scaled_dot_product_attention(q, k, k, attn_mask=mask[..., :n],
                                                       enable_gqa=q.shape[1] != k.shape[1])
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
            except RuntimeError as exc:  # the kernel cannot run this shape here
                error = str(exc).strip().splitlines()[0][:160]
            rows.append({"model": model, "kernel": BACKEND_NAMES[name],
                         "first_ms": times[0] * 1e3 if times else None,
                         "median_ms": statistics.median(times[1:]) * 1e3
                         if len(times) > 1 else None, "error": error})
    return rows


def tiny_modes(modes: list[str], dtype: str, device: torch.device, new_tokens: int = 8
               ) -> list[dict]:
    """Each shipped tiny model decoded greedily in each mode, its readouts at every depth (the
    depth trace's top-1 token and probability) against a full forward over the same tokens."""
    rows = []
    prompt = list(b"def main():\n    ")
    for name in ("huginn-tiny", "ouro-tiny"):
        model = load_model(name, device=device, dtype=dtype)
        depth = model.config.depth
        reference_tokens = None
        for mode in modes:
            run = generate(model, prompt, schedule="ar", max_new_tokens=new_tokens,
                           depth_trace=True, mode=mode)
            reference_tokens = reference_tokens or run.tokens
            logits = full_forward(model, prompt + run.tokens[:-1],
                                  readout_depths=list(range(1, depth + 1)))
            agree, diff = [], 0.0
            for record in run.depth_records:
                for i, r in enumerate(range(1, depth + 1)):
                    probs = torch.softmax(logits[r][record.position].float(), -1)
                    agree.append(int(probs.argmax()) == record.predictions[i])
                    diff = max(diff, abs(float(probs.max()) - record.top1_prob[i]))
            rows.append({"model": name, "mode": mode, "tokens_equal_first_mode":
                         run.tokens == reference_tokens,
                         "argmax_agreement_with_full_forward": sum(agree) / len(agree),
                         "max_top1_prob_difference": diff,
                         "attention_backend": run.stats["attention_backend"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="default: bf16 on CUDA, fp32 elsewhere")
    parser.add_argument("--modes", nargs="+", default=None,
                        choices=("eager", "static", "graphs"),
                        help="default: eager static graphs on CUDA, eager static elsewhere")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device (torch "
                     f"{torch.__version__}); --device cpu runs the eager and static checks")
    if not cuda and "graphs" in (args.modes or ()):
        parser.error("--modes graphs captures CUDA graphs: it needs --device cuda")
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    modes = args.modes or (["eager", "static", "graphs"] if cuda else ["eager", "static"])
    started = time.perf_counter()
    report = {"versions": versions(device)}
    print(" ".join(f"{k}={v}" for k, v in report["versions"].items()))
    torch_dtype = DTYPES[dtype]
    report["backends"] = chosen(torch_dtype, device)
    print("\nattention kernel chosen (decoder's policy / PyTorch unrestricted):")
    for row in report["backends"]:
        print(f"  {row['model']:12} {row['queries']:40} span {row['span']:5}: "
              f"{row['decoder']} / {row['unrestricted']}")
    report["growing_keys"] = timed_growing_keys(torch_dtype, device)
    print("\neager attention, one query, keys growing one per call from 1,024 (ms):")
    for row in report["growing_keys"]:
        figures = (f"first {row['first_ms']:.3f}, then median {row['median_ms']:.3f}"
                   if row["error"] is None else f"cannot run: {row['error']}")
        print(f"  {row['model']:12} {row['kernel']:10} {figures}")
    report["tiny_models"] = tiny_modes(modes, dtype, device)
    print("\nshipped tiny models, greedy, every depth's readout against a full forward:")
    for row in report["tiny_models"]:
        print(f"  {row['model']:12} {row['mode']:7} tokens as {modes[0]}: "
              f"{row['tokens_equal_first_mode']}, argmax agreement "
              f"{row['argmax_agreement_with_full_forward']:.3f}, max |top-1 p difference| "
              f"{row['max_top1_prob_difference']:.2e}, attention {row['attention_backend']}")
    report["seconds"] = time.perf_counter() - started
    print(f"\n{report['seconds']:.1f} s")
    if args.json is not None:
        atomic_write(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
