"""The `--json` of `costmodel predict` and `recommend` on a fixed set of arguments, and of
`costmodel validate` on every committed profile, against the outputs committed in
tests/data/cli_outputs.json: a restructuring must not move a figure.

After a change that is meant to move them: `python tests/test_cli_outputs.py --write`."""

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ROOT / "tests" / "data" / "cli_outputs.json"
P = "costmodel/data/profiles/"  # run from the repository root

COMMANDS = [
    "predict",
    "predict --bandwidth 768GB/s --width 8",
    "predict --model ouro-2.6b --hardware a6000 --mode eager --host-speed 2",
    "predict --model ouro-2.6b --hardware a6000 --mode graphs --batch 4 --context 4096",
    "predict --model huginn-3.5b --hardware h200 --engine vllm --acceptance 0.9 --draft-depth 4",
    "predict --model huginn-3.5b --hardware a6000 --exit kl:0.001 --min-depth 4"
    " --exit-depths 8:0.3,16:0.5,32:0.2",
    "predict --model huginn-3.5b --kv-sharing 4 --launch-overhead 5us --flops 100TFLOPS",
    f"predict --profile {P}gpu-huginn-bf16.json --mode graphs --width 4",
    f"predict --profile {P}gpu-ouro-bf16.json --prompts 4 --new-tokens 64",
    f"predict --profile {P}cpu-huginn-fp32.json --model huginn-tiny --batch 4 --block-length 3",
    f"predict --profile {P}cpu-ouro-fp32.json --model ouro-tiny --acceptance 0.7",
    "recommend --acceptance-by-depth 1:0.5,2:0.7,4:0.85,8:0.95",
    "recommend --model ouro-2.6b --hardware a6000 --batch 4 --top 3"
    " --acceptance-by-depth 1:0.8,2:0.9",
    f"recommend --profile {P}cpu-huginn-fp32.json --model huginn-small"
    " --acceptance-by-depth 2:0.6,4:0.8,8:0.95",
    f"recommend --profile {P}gpu-ouro-bf16.json --context 2048 --acceptance-by-depth 1:0.75",
    *(f"validate --profile {P}{path.name}" for path in sorted((ROOT / P).glob("*.json"))
      if not path.name.endswith(".validation.json")),
]


def run(command: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plot = ["--plot", f"{tmp}/plot.png"] if command.startswith("validate") else []
        out = subprocess.run([sys.executable, "-m", "costmodel", *command.split(), *plot,
                              "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, f"{command}: {out.stderr}"
    result = json.loads(out.stdout)
    result.pop("plot", None)  # the temporary folder's name
    return result


def close(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: floats to 1e-12 relative (a last digit that another CPU's
    math library may round apart), everything else exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in close(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in close(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        same = math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
        return [] if same else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("command", COMMANDS)
def test_json_output_unchanged(command):
    expected = json.loads(OUTPUTS.read_text())[command]
    assert close(run(command), expected) == []


def test_a_changed_figure_is_found():
    assert close({"a": [1.0, 2.0]}, {"a": [1.0, 2.0 * (1 + 1e-9)]}) == [".a[1]: 2.0 != 2.000000002"]
    assert close({"a": [1.0]}, {"a": [1.0 + 1e-14]}) == []
    assert close({"a": 1}, {"b": 1}) == [": keys ['a', 'b']"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    OUTPUTS.write_text(json.dumps({c: run(c) for c in COMMANDS}, indent=1) + "\n")
