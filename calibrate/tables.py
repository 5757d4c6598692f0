"""The operation tables the cost model prices presets with: this decoder's
(costmodel/data/operations.json, calibrate.operations) and vLLM's through the plugin
(costmodel/data/vllm_operations.json, calibrate.vllm_kernels), counted again and written by one
command (printed without --write; vLLM's needs the serve-cpu extra):

    python -m calibrate.tables [--tables decoder vllm] [--write [--out-dir DIR]]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from costmodel.presets import DATA_DIR

from .operations import FAMILY_PRESETS, family_operations

WRITE_COMMAND = "python -m calibrate.tables --write"


def tables(which: list[str]) -> dict[str, dict]:
    """The operation tables named (``decoder``, ``vllm``), by their file names, as committed."""
    out = {}
    if "decoder" in which:
        out["operations.json"] = {"command": WRITE_COMMAND, "dtype": "bf16",
                                  "families": family_operations("bf16")}
    if "vllm" in which:
        from .vllm_kernels import family_kernels

        out["vllm_operations.json"] = {"command": WRITE_COMMAND, "families": {
            family: family_kernels(preset) for family, preset in FAMILY_PRESETS.items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=("decoder", "vllm"),
                        default=["decoder", "vllm"])
    parser.add_argument("--write", action="store_true",
                        help="write the tables (to the cost model's data, or --out-dir)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.out_dir is not None and not args.write:
        parser.error("--out-dir goes with --write")
    from costmodel.trace import atomic_write

    for name, table in tables(args.tables).items():
        text = json.dumps(table, indent=1) + "\n"
        if args.write:
            path = (args.out_dir or DATA_DIR) / name
            atomic_write(path, text)
            print(f"wrote {path}")
        else:
            print(f"{name}: {text}")


if __name__ == "__main__":  # vLLM's engine starts only under this guard
    main()
