"""The shipped request-length distributions (``costmodel/data/lengths/``), made from a public
trace of prompt and output lengths: a joint histogram over quarter-octave bins, so that a stream
drawn from it keeps how prompt and output lengths go together, with no request of the trace in
it.

    python bench/length_samples.py TRACE.csv --name azure-conv-2023 --about "..." \
        --source "..." [--out costmodel/data/lengths/azure-conv-2023.json]

TRACE: a CSV with the columns ContextTokens and GeneratedTokens (the Azure LLM inference trace
2023's, https://github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv and
_code.csv, CC BY 4.0).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from costmodel.clitools import script_main
from costmodel.requests import LengthSample
from costmodel.trace import atomic_write

ROOT = Path(__file__).resolve().parents[1]


def quarter_octaves(largest: int) -> list[int]:
    """Bin edges 1, 2, 3, ..., 16, 19, 23, 27, 32, ... (each about 2 ** 0.25 times the last,
    whole tokens), the last past ``largest``."""
    edges, k = [1], 0
    while edges[-1] <= largest:
        k += 1
        edges.append(max(edges[-1] + 1, round(2 ** (k / 4))))
    return edges


def sample_of(path: Path, name: str, about: str, source: str) -> LengthSample:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} holds no request")
    try:
        prompts = np.array([int(r["ContextTokens"]) for r in rows])
        outputs = np.array([int(r["GeneratedTokens"]) for r in rows])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: expected whole numbers in the columns ContextTokens and "
                         f"GeneratedTokens ({exc})") from None
    prompt_edges, output_edges = quarter_octaves(prompts.max()), quarter_octaves(outputs.max())
    counts, _, _ = np.histogram2d(prompts, outputs, bins=[prompt_edges, output_edges])
    cells = [[i, j, int(n)] for (i, j), n in np.ndenumerate(counts) if n]
    return LengthSample(name=name, about=about, source=source, requests=len(rows),
                        prompt_edges=prompt_edges, output_edges=output_edges, cells=cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--about", required=True, help="what the requests are, one sentence")
    parser.add_argument("--source", required=True, help="where the trace comes from, licence")
    parser.add_argument("--out", type=Path, help="default: costmodel/data/lengths/NAME.json")
    args = parser.parse_args()
    sample = sample_of(args.trace, args.name, args.about, args.source)
    out = args.out or ROOT / "costmodel" / "data" / "lengths" / f"{args.name}.json"
    atomic_write(out, sample.model_dump_json() + "\n")
    prompts, outputs = sample.mean_tokens()
    print(f"{out}: {sample.requests} requests, {len(sample.cells)} cells, mean prompt "
          f"{prompts:.0f} and output {outputs:.0f} tokens")


if __name__ == "__main__":
    script_main(main)
