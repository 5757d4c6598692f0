"""The GPU campaign's script (calibrate/gpu.sh), rehearsed on the CPU as the GPU image runs it:
its wheels, its reference baseline, its archive, and a step that fails."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import bench_module

from costmodel.profile import (
    load_profile,
)
from costmodel.store import PROFILES_DIR

WHEELED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection",
           "typing_extensions")


def image_like_interpreter(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(an interpreter, its PYTHONPATH, a folder of wheels) like the GPU image's: it sees this
    environment's packages but not the project's install, nor pydantic and its companions, which
    come as wheels (repacked here from the installed distributions)."""
    import importlib.metadata
    import site
    import zipfile

    packages = Path(site.getsitepackages()[0])
    visible = tmp_path / "image-site"
    visible.mkdir()
    hidden = {name.replace("_", "-") for name in WHEELED} | {"looped-decoding"}
    hidden_paths = {packages / "__editable__.looped_decoding-0.1.0.pth"}
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist in importlib.metadata.distributions(path=[str(packages)]):
        name = dist.metadata["Name"].lower().replace("_", "-")
        files = [f for f in dist.files or [] if not str(f).startswith("..")]
        if name not in hidden:
            continue
        hidden_paths |= {packages / Path(str(f)).parts[0] for f in files}
        if name == "looped-decoding":
            continue
        with zipfile.ZipFile(wheels / f"{name.replace('-', '_')}-0-py3-none-any.whl", "w") as z:
            for f in files:
                if (packages / f).is_file():
                    z.write(packages / f, str(f))
    for entry in packages.iterdir():
        if entry not in hidden_paths and entry.suffix != ".pth":
            (visible / entry.name).symlink_to(entry)
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    return python, visible, wheels


# A stand-in for the public reference code: loads the saved checkpoint with the decoder and
# decodes with its AR, behind the reference's class and `generate`; it imports a module that only
# the family's REF_WHEELS put on the path.
FAKE_REFERENCE = """
import torch
import refmark  # noqa: F401
from wfd.checkpoint import load_folder
from wfd.generate import generate


class OuroForCausalLM:
    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None):
        ref = cls()
        ref.model = load_folder(folder, dtype=torch_dtype)
        return ref

    def to(self, device):
        return self

    def eval(self):
        return self

    def generate(self, x, max_new_tokens, **kw):
        ids = x[0].tolist()
        out = generate(self.model, ids, max_new_tokens=max_new_tokens, record=False)
        return torch.tensor([ids + out.tokens])
"""


def stand_in_reference(tmp_path: Path) -> tuple[Path, Path]:
    """(a stand-in for the public Ouro reference code, REF_WHEELS for it: DIR/ouro holds the
    wheel of the module it imports)."""
    import zipfile

    reference = tmp_path / "ouro_ref"
    reference.mkdir()
    (reference / "__init__.py").write_text("")
    (reference / "modeling_ouro.py").write_text(FAKE_REFERENCE)
    (tmp_path / "refw" / "ouro").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "refw" / "ouro" / "refmark-0-py3-none-any.whl", "w") as z:
        z.writestr("refmark.py", "")
    return reference, tmp_path / "refw"


@pytest.mark.slow
def test_the_gpu_script_rehearsed_as_the_gpu_image_runs_it(tmp_path):
    """The campaign from a checkout the interpreter cannot import (no install, no pydantic: its
    wheels unpacked by the script), at tiny size on the CPU, one family: every file it makes is
    in the one archive, and the archive holds what the campaign promises."""
    import tarfile

    python, visible, wheels = image_like_interpreter(tmp_path)
    probe = subprocess.run([str(python), "-c", "import pydantic"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(visible)}, cwd=tmp_path)
    assert probe.returncode != 0  # the rehearsal's interpreter is as bare as the image
    reference, ref_wheels = stand_in_reference(tmp_path)
    # the machine's measurements come from a shipped profile (their own test measures them)
    machine = PROFILES_DIR / "cpu-ouro-fp32-quick.json"
    results = tmp_path / "run"
    env = {"DEVICE": "cpu", "DTYPE": "fp32", "QUICK": "1", "SIZES": "smallest",
           "RESULTS": str(results), "ARCHIVE": str(tmp_path / "back" / "campaign.tar.gz"),
           "PYTHON": str(python), "PYTHONPATH": str(visible), "WHEELS": str(wheels),
           "FAMILIES": "ouro", "BENCH_CONTEXT": "16",
           "BENCH_TOKENS": "8", "BENCH_REPEATS": "1", "MACHINE_FROM": str(machine),
           "ACCEPTANCES": "0.6,0.9", "BATCH": "1", "BATCHES": "1 2", "BATCH_CONTEXT": "16",
           "BATCH_TOKENS": "8", "BATCH_BLOCK_LENGTHS": "4", "BATCH_RETRIES": "0",
           "STEP_SECONDS": "400", "REF_OURO": str(reference),
           "REF_WHEELS": str(ref_wheels)}
    out = subprocess.run(["bash", "calibrate/gpu.sh"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    made = {str(p.relative_to(tmp_path)) for p in results.rglob("*") if p.is_file()}
    with tarfile.open(tmp_path / "back" / "campaign.tar.gz") as archive:
        packed = {m.name for m in archive.getmembers() if m.isfile()}
        archive.extractall(tmp_path / "back", filter="data")
    assert packed == made
    assert {"run/smoke.json", "run/campaign.log", "run/gpu-ouro-fp32.json",
            "run/gpu-ouro-fp32.validation.json", "run/gpu-ouro-fp32.png",
            "run/bench-ouro-fp32.json", "run/bench-ouro-fp32.md", "run/batch-ouro-fp32.json",
            "run/batch-ouro-fp32.md", "run/bench-exits-ouro-fp32.json"} <= packed
    _check_the_campaign(tmp_path / "back" / "run", load_profile(machine))


def _check_the_campaign(back: Path, machine) -> None:
    """What a rehearsed campaign's archive holds: the benches beside the reference, the exit
    and batch benches, the profile and its validation (``machine``: the profile its machine's
    measurements came from)."""
    bench = json.loads((back / "bench-ouro-fp32.json").read_text())
    *ours, ref = bench["rows"]  # the reference's generate, on its own wheels, is the baseline
    assert {row["schedule"].split()[0] for row in ours} == {"AR", "DtV", "WFD"}
    assert all(row["tokens_per_s"] > 0 and row["mode"] == "eager" for row in ours)
    assert ref["mode"] == "reference" and ref["ms_per_token"] > 0
    assert ours[0]["x_reference"] == pytest.approx(ref["ms_per_token"] / ours[0]["ms_per_token"])
    table = (back / "bench-ouro-fp32.md").read_text()
    assert "| ouro-tiny:random | eager | AR |" in table and "decode x reference" in table
    exits = json.loads((back / "bench-exits-ouro-fp32.json").read_text())["rows"]
    assert all("forced exits 2:0.5,3:0.25,4:0.25" in row["decode"] for row in exits)
    assert json.loads((back / "smoke.json").read_text())["tiny_models"]
    assert {r["batch"] for r in json.loads((back / "batch-ouro-fp32.json").read_text())["runs"]
            } == {1, 2}
    profile = load_profile(back / "gpu-ouro-fp32.json")
    assert profile.validation and profile.fit_stats["train_points"] > 5
    assert profile.load.retaken_fraction == 0  # gpu.sh's --retries 0: nothing taken again
    assert len(profile.training) == profile.fit_stats["train_points"]  # kept for refits
    report = json.loads((back / "gpu-ouro-fp32.validation.json").read_text())
    assert set(report["per_schedule"]) >= {"ar", "wfd", "dtv", "block"}
    # the held-out runs sweep the forced acceptance (DtV and WFD at each, AR once)
    runs = [p.label for p in profile.validation if p.kind == "run"]
    assert len(runs) == 5 and sum(label.endswith(" a=0.6") for label in runs) == 2
    assert report["per_token"]["points"] >= 3 and report["per_call"]["points"] > 20
    # every held-out point keeps each of its measurements, the least as its figure
    assert all(len(p.repeats_s) == 2 and  # quick: two passes, runs in two rounds
               p.measured_s == min(p.repeats_s) for p in profile.validation)
    assert report["repeat_spread"]["per_call"]["points"] == report["per_call"]["points"]
    assert profile.threads >= 1  # the CPU threads the decoder ran on
    assert profile.checks[0].startswith("machine: the measurements of cpu-ouro-fp32-quick")
    assert profile.hardware.cpu.matmul.seconds == machine.hardware.cpu.matmul.seconds


SLOW_REFERENCE = """
import time


class OuroForCausalLM:
    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None):
        time.sleep(60)
"""


@pytest.mark.parametrize("package, code, seconds, failure", [
    # without its wheels the reference's import fails (gpu.sh puts them on its bench's path)
    ("ouro_ref", FAKE_REFERENCE, "60", "ModuleNotFoundError: No module named 'refmark'"),
    # one that loads for ever (a lent GPU's transformers at the real size) is given up
    ("slow_ouro_ref", SLOW_REFERENCE, "0.5",
     "TimeoutError: its load and runs took more than 0.5 s")],
    ids=["import fails", "too slow"])  # a package each: the bench imports it by its name
def test_a_reference_that_fails_costs_the_bench_only_itself(tmp_path, monkeypatch, capsys,
                                                            package, code, seconds, failure):
    """The reference is the campaign's baseline, not its headline: one that fails or runs past
    --reference-seconds is named as failed (exit 1, which gpu.sh names as the failed step), and
    the decoder's rows are printed and written."""
    reference = tmp_path / package
    reference.mkdir()
    (reference / "__init__.py").write_text("")
    (reference / "modeling_ouro.py").write_text(code)
    decode_speed = bench_module("decode_speed")

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", [
        "decode_speed.py", "schedules", "--models", "ouro-tiny:random", "--context", "8",
        "--prompts", "1", "--new-tokens", "4", "--repeats", "1", "--block-lengths", "2",
        "--reference-ouro", str(reference), "--reference-seconds", seconds, "--out", str(out),
        "--threads", "1"])
    started = time.perf_counter()
    with pytest.raises(SystemExit, match=failure):
        decode_speed.main()
    assert time.perf_counter() - started < 30
    assert "| ouro-tiny:random | eager | AR |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert {row["schedule"].split()[0] for row in rows} == {"AR", "DtV", "WFD"}


def test_gpu_script_goes_on_past_a_failed_step_and_names_it(tmp_path):
    """One failed calibration must not cost the rest of a lent machine's time: the script
    reports it, runs what does not need it, packs what it has, and exits 1 naming it; a step
    past the time budget is skipped and named."""
    import tarfile

    env = {"DEVICE": "cpu", "DTYPE": "fp32", "QUICK": "1", "SIZES": "smallest",
           "RESULTS": str(tmp_path / "run"), "PYTHON": sys.executable, "FAMILIES": "ouro",
           "BENCH": "0", "MACHINE_FROM": str(tmp_path / "missing.json")}
    # the smoke step left out (the rehearsal above runs it): a rerun on the same machine
    out = subprocess.run(["bash", "calibrate/gpu.sh"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env, "SMOKE": "0"})
    assert out.returncode == 1
    assert "failed steps: ouro eager calibration" in out.stderr
    assert "cannot read profile" in out.stderr and "Traceback" not in out.stderr
    assert "STEP: smoke" not in out.stderr
    with tarfile.open(tmp_path / "run.tar.gz") as archive:
        assert "run/campaign.log" in archive.getnames()
    spent = subprocess.run(["bash", "calibrate/gpu.sh"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env, "BUDGET_SECONDS": "0"})
    assert spent.returncode == 1 and "SKIPPED: smoke" in spent.stderr
    assert "ouro eager calibration (skipped)" in spent.stderr
