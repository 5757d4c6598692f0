"""A refused command prints its one line alone, on any machine, whatever profile it was given:
the notes on how a command runs (a profile measured on another machine, one rescaled to this
machine) are printed only once it goes on to run. Each command runs on a machine named
explicitly as another than the committed profiles' (LOOPED_DECODING_MACHINE), so the test means
the same on every machine; each refusal has a twin that runs and prints the note."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.store import PROFILES_DIR

PROFILES = PROFILES_DIR
HUGINN = str(PROFILES / "cpu-huginn-fp32-quick.json")
OURO = str(PROFILES / "cpu-ouro-fp32-quick.json")
ELSEWHERE = "Another CPU, 4 CPUs"
MEASURED_ELSEWHERE = "was measured on 'AMD EPYC, 2 CPUs', not this machine"
RESCALED = "(cpu, rescaled from AMD EPYC, 2 CPUs)"  # auto's note on the profile it chose


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOOPED_DECODING_MACHINE": ELSEWHERE,
           "LOOPED_DECODING_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


# (refused, runs, the note the run prints): the same command and profile
CASES = {
    "predict": (["costmodel", "predict", "--profile", HUGINN, "--model", "huginn-tiny",
                 "--mode", "graphs"],
                ["costmodel", "predict", "--profile", HUGINN, "--model", "huginn-tiny"],
                MEASURED_ELSEWHERE),
    "predict --engine vllm": (
        ["costmodel", "predict", "--profile", HUGINN, "--model", "huginn-tiny", "--engine",
         "vllm", "--mode", "graphs"],  # vLLM's CUDA graphs on a CPU's profile
        ["costmodel", "predict", "--profile", HUGINN, "--model", "huginn-tiny", "--engine",
         "vllm", "--json"],
        MEASURED_ELSEWHERE),
    "recommend": (["costmodel", "recommend", "--profile", HUGINN, "--model", "huginn-tiny",
                   "--acceptance-by-depth", "1:0.5,9:0.9"],
                  ["costmodel", "recommend", "--profile", HUGINN, "--model", "huginn-tiny",
                   "--acceptance-by-depth", "1:0.5,4:0.9", "--top", "1"],
                  MEASURED_ELSEWHERE),
    "study": (["costmodel", "study", "paper-table", "--profile", OURO],  # a GPU study
              ["costmodel", "study", "width", "--profile", OURO, "--json"],
              MEASURED_ELSEWHERE),
    "generate --schedule auto": (
        ["wfd", "generate", "--model", "huginn-tiny", "--prompt", "x", "--schedule", "auto",
         "--max-new-tokens", "100000"],
        ["wfd", "generate", "--model", "huginn-tiny", "--prompt", "x", "--schedule", "auto",
         "--max-new-tokens", "4"],
        RESCALED),
    "generate --schedule auto, KV sharing": (
        ["wfd", "generate", "--model", "huginn-tiny", "--prompt", "x", "--schedule", "auto",
         "--max-new-tokens", "4", "--kv-sharing", "99"],
        None, None),
    "generate --schedule auto --depth-trace": (
        ["wfd", "generate", "--model", "huginn-tiny", "--prompt", "x", "--schedule", "auto",
         "--depth-trace", "d.jsonl"],
        None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_command_prints_its_one_line_alone(tmp_path, case):
    refused, runs, said = CASES[case]
    out = run(tmp_path, *refused)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    if runs is not None:  # the same profile on this machine, and input it takes: the note
        ran = run(tmp_path, *runs)
        assert ran.returncode == 0, ran.stderr
        assert said in ran.stderr


def test_validate_and_check_profile_refuse_in_one_line(tmp_path):
    """A profile without calls: nothing to validate or time again, on a machine not its own;
    a negative count of retries."""
    empty = tmp_path / "empty.json"
    raw = json.loads(Path(HUGINN).read_text())
    raw["validation"], raw["training"] = [], []
    empty.write_text(json.dumps(raw))
    for command in (["validate", "--profile", str(empty)],
                    ["check-profile", "--profile", str(empty)],
                    ["check-profile", "--profile", HUGINN, "--retries", "-1"]):
        out = run(tmp_path, "costmodel", *command)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, (command, out.stderr)
