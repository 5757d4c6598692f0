"""Where exits pay on vLLM, by model size: continuous depth batching at forced exit depths on
random Huginn models of growing width, the plugin's exit mode against vLLM's own forward at
fixed depth. A tiny model's call costs about the same whatever its rows, so a token that stops
iterating frees little; a wide one's call grows with its rows, and there the freed rows pay.

    python bench/exit_widths.py [--models huginn-tiny huginn-small:random huginn-mid:random]
        [--depth 8] [--exits 2:0.25,3:0.5,4:0.25] [--batches 1 16] [--new-tokens 64]
        [--repeats 2] [--profile PROFILE.json [--overheads STEP SEQUENCE TICK WAVE]]
        [--out F.json]

Each model (a shipped one, or PRESET:random: the preset's architecture, random weights, in the
public layout) runs at recurrence depth --depth; each decoded token of the exit mode stops at a
depth drawn by its position from --exits (``forced:``, as `wfd generate --force-exits`), whatever
the weights say: timing, not a decode. Prompts of 32 random token ids, --new-tokens greedy each;
batch B sends B requests at once (batch 1: four, one at a time). Rows: ``model``, ``width``,
``batch``, ``fixed_tokens_per_s`` (vLLM's forward at fixed depth), ``exit_tokens_per_s``,
``wave_fixed_tokens_per_s`` (the exit mode's machinery at fixed depth), ``mean_exit_depth`` and,
with --profile (calibrated on this machine), ``predicted_speedup`` (`costmodel predict --engine
vllm --exit-depths`), with --overheads the engine's own time per step, per sequence in a step,
per tick and per wave in a tick (`--step-overhead --sequence-overhead --tick-overhead
--wave-overhead`, as bench/vllm_predicted.py fits them: e.g. 2.70ms 0.21ms 0.29ms 0.10ms).
Exits non-zero where vLLM's tokens are not wfd's AR's with the same forced depths. The engines
use both cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from costmodel.cli_options import engine_overheads
from costmodel.engines import EngineOverheads
from costmodel.profile import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from depth_batching import predicted_pair, requests_of, vllm_pass  # noqa: E402
from vllm_tensor_parallel import checkpoint  # noqa: E402

from costmodel.clitools import script_main  # noqa: E402
from wfd.checkpoint import load_model  # noqa: E402
from wfd.generate import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32


def folder_of(name: str, tmp: Path) -> Path:
    """A shipped model's folder, or random weights of a preset's architecture saved in one."""
    if not name.endswith(":random"):
        return ROOT / "wfd" / "models" / name
    preset = name.removesuffix(":random")
    return checkpoint(preset, tmp / preset)


def model_rows(name: str, args, tmp: Path) -> list[dict]:
    folder = folder_of(name, tmp)
    model = load_model(str(folder))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, PROMPT_TOKENS).tolist()
               for _ in range(max(max(args.batches), 4))]
    rule = f"forced:{args.exits}"
    plan = {"recurrence_depth": args.depth}
    passes = []
    for i in range(args.repeats):
        print(f"{name}: pass {i + 1} of {args.repeats}", file=sys.stderr, flush=True)
        passes.append(vllm_pass(folder, prompts, args.batches, args.new_tokens, [rule], plan))
    smallest = min(args.batches)
    ours = [generate(model, p, max_new_tokens=args.new_tokens, schedule="ar", depth=args.depth,
                     force_exits=args.exits, record=False)
            for p in requests_of(prompts, smallest)]
    if passes[0][rule, smallest][1] != [r.tokens for r in ours]:
        sys.exit(f"error: vLLM's tokens with {rule} differ from wfd's AR's on {name}")
    depths = [d for r in ours for d in r.stats["exit_depths"]]
    rows = []
    def median(key, b, at=0):
        return statistics.median(p[key, b][at] for p in passes)

    for b in args.batches:

        row = {"model": name, "width": model.config.hidden_size, "depth": args.depth,
               "exits": args.exits, "batch": b, "fixed_tokens_per_s": median("fixed", b),
               "exit_tokens_per_s": median(rule, b), "wave_fixed_tokens_per_s": median("none", b),
               "mean_exit_depth": median(rule, b, 2)}
        if args.profile:
            preset = name.removesuffix(":random")
            fixed, exits = predicted_pair(args.profile, preset, b, args.new_tokens, plan,
                                          (rule, depths), args.engine, PROMPT_TOKENS)
            row["predicted_speedup"] = exits.tokens_per_s / fixed.tokens_per_s
        rows.append(row)
    return rows


def overheads(times: list[str] | None) -> EngineOverheads | None:
    """The engine's own time per step, sequence, tick and wave (``--overheads``), or none."""
    if not times:
        return None
    step, sequence, tick, wave = times
    return engine_overheads(step, sequence, tick=tick, wave=wave)


def table(rows: list[dict]) -> str:
    lines = ["| model | width | batch | mean exit depth | vLLM AR tok/s | exit tok/s | x | "
             "predicted | exit mode at R tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
        lines.append(f"| {r['model']} | {r['width']} | {r['batch']} | {r['mean_exit_depth']:.2f}"
                     f" | {r['fixed_tokens_per_s']:.0f} | {r['exit_tokens_per_s']:.0f} | "
                     f"{r['exit_tokens_per_s'] / r['fixed_tokens_per_s']:.2f}x | {predicted} | "
                     f"{r['wave_fixed_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    # GiB of KV for each engine: a wide preset's cache at its full context (huginn-mid: 1.1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+",
                        default=["huginn-tiny", "huginn-small:random", "huginn-mid:random"])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--exits", default="2:0.25,3:0.5,4:0.25")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--overheads", nargs=4, metavar=("STEP", "SEQUENCE", "TICK", "WAVE"),
                        help="the engine's own time for the predictions, e.g. 2.70ms 0.21ms "
                             "0.29ms 0.10ms")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.engine = overheads(args.overheads)  # bad units refused before the run
    args.profile = args.profile and load_profile(args.profile)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for name in args.models for row in model_rows(name, args, Path(tmp))]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    script_main(main)
