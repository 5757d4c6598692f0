"""Is vLLM's speculative sampling lossless on this build? A model of vLLM's own (a small random
Llama, no plugin involved) sampled at T = 1 with and without speculative decoding (the same folder
as draft model, vLLM's draft_model method), the tokens after the prefill's compared position by
position (chi-square homogeneity, rare tokens pooled): p-values far below 0.001 mean the
speculative path does not sample from the model's distribution. Run it after a vLLM upgrade to
see whether DtV's sampled mode (docs/serving.md) can be trusted.

    python bench/vllm_spec_sampling.py [--requests 400] [--speculative-tokens 3]

Needs the serve-cpu extra (vLLM's CPU build). Prints one line per position.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sample(folder: Path, requests: int, speculative_tokens: int | None, tmp: Path
           ) -> list[list[int]]:
    """Each request's 4 new tokens (T = 1, unseeded), from an engine of its own."""
    from wfd.serving.offline import run_apart

    job = {"model": str(folder), "in_process": True, "speculative_tokens": speculative_tokens,
           "runs": [{"prompts": [list(b"import os\n")] * requests, "max_tokens": 4,
                     "batch": 50, "temperature": 1.0, "seed": None}]}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return run_apart(job, env=env, cwd=tmp)["runs"][0]["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from test_speculative import same_distribution_pvalue

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked distribution, far from one-hot
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        model.save_pretrained(folder, safe_serialization=True)
        plain = sample(folder, args.requests, None, Path(tmp))
        speculative = sample(folder, args.requests, args.speculative_tokens, Path(tmp))
    for i in range(len(plain[0])):
        p = same_distribution_pvalue([[t[i]] for t in plain], [[t[i]] for t in speculative])
        origin = "the prefill" if i == 0 else "verified"
        print(f"token {i + 1} ({origin}): p = {p:.2g}")


if __name__ == "__main__":
    main()
