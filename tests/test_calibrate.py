"""Calibration: the fit recovers known coefficients, profiles round-trip, bad profiles fail
clearly, and the whole pipeline runs end to end on tiny models."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cpu_like_product_s, synthetic_curve

from calibrate.fit import (
    CPU_PARAMETERS,
    F_SCALE,
    PARAMETERS,
    Observation,
    fit,
    predict_calls,
    undetermined,
)
from calibrate.validate import predict_point
from costmodel import get_hardware, get_model
from costmodel.hardware import CpuTerms, HardwareSpec
from costmodel.profile import (
    CalibrationProfile,
    FittedValue,
    HeldValue,
    LoadReport,
    ProfileError,
    load_profile,
    save_profile,
)
from costmodel.store import PROFILES_DIR, cpu_machine_name
from costmodel.trace import CallRecord

CPU = HardwareSpec(name="synthetic cpu", memory_bandwidth_bytes_per_s=20e9,
                   peak_flops_per_s={"fp32": 100e9}, memory_capacity_bytes=24e9,
                   kernels_per_layer=14, matmul=synthetic_curve(cpu_like_product_s))
TRUTH = {"host_overhead_s": 40e-6, "launch_overhead_s": 6e-6, "layer_overhead_s": 30e-6,
         "bandwidth_efficiency": 0.55, "attention_flops_efficiency": 0.1,
         "matmul_time_scale": 1.3, "attention_key_set_s": 3e-6}


def synthetic(hw: HardwareSpec, noise: float, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    obs = []
    for preset in ("huginn-tiny", "huginn-mid", "ouro-mid"):
        spec = get_model(preset)
        for n in (1, 2, 3, 4, 8, 16, 64):  # 64 rows of the mid models are compute-bound
            for ctx in (64, 1024, 4096):
                for slots in sorted({1, n}):
                    positions = list(range(ctx, ctx + n))
                    depths = [1 + i % slots for i in range(n)]
                    rec = CallRecord(kind="block", positions=positions, depths=depths,
                                     contexts=[p + 1 for p in positions],
                                     slots=[d - 1 for d in depths])
                    obs.append(Observation(spec, rec, 0.0))
            rec = CallRecord(kind="coda", positions=[ctx], depths=[4], contexts=[ctx + 1],
                             slots=[3])
            obs.append(Observation(spec, rec, 0.0))
    times = predict_calls(hw, obs, "fp32") * np.exp(rng.normal(0, noise, len(obs)))
    for o, t in zip(obs, times, strict=True):
        o.seconds = float(t)
    return obs


def test_fit_recovers_known_coefficients():
    truth = CPU.with_terms(**TRUTH)
    result = fit(CPU, synthetic(truth, noise=0.01), "fp32")
    assert set(result.values) == set(TRUTH) and not result.dropped  # the CPU's set, all kept
    for name, value in TRUTH.items():
        # the per-call, per-layer and per-key-set terms all grow with a call's layers, so the
        # calls tell them apart less sharply: each within three of its standard errors
        assert abs(result.values[name] - value) < 3 * result.stderr[name], name
        assert result.stderr[name] < 0.2 * value, name
    assert np.median(np.abs(result.residuals)) < 0.02


def test_fit_frees_only_the_coefficients_it_is_given():
    truth = CPU.with_terms(**TRUTH)
    free = [p for p in CPU_PARAMETERS if p.name != "attention_flops_efficiency"]
    start = CPU.with_terms(**{"attention_flops_efficiency": 0.1})
    result = fit(start, synthetic(truth, noise=0.01), "fp32", free)
    assert "attention_flops_efficiency" not in result.values
    assert result.hardware.roofline.attention_flops_efficiency == 0.1
    assert result.values["matmul_time_scale"] == pytest.approx(1.3, rel=0.05)


def test_a_fit_with_nothing_left_free_reports_its_loss():
    """Every coefficient held (or taken out): the profile still gets a number for its loss,
    the one the fit minimizes (a NaN would be written as null and the profile not load)."""
    from scipy.optimize import least_squares

    obs = synthetic(CPU.with_terms(**TRUTH), noise=0.05)
    result = fit(CPU, obs, "fp32", [])
    assert not result.values and np.isfinite(result.stats()["cost"])
    logs = np.log(predict_calls(CPU, obs, "fp32")) - np.log([o.seconds for o in obs])
    same = least_squares(lambda x: logs + 0 * x, [0.0], loss="soft_l1", f_scale=F_SCALE,
                         max_nfev=1)
    assert result.cost == pytest.approx(same.cost)


def test_a_term_the_calls_cannot_tell_apart_is_taken_out():
    # no host overhead per call in the truth: the fit drops the term and says why, and the
    # rest still fit
    truth = CPU.with_terms(**{**TRUTH, "host_overhead_s": 0.0})
    result = fit(CPU, synthetic(truth, noise=0.01), "fp32")
    assert "host_overhead_s" in result.dropped and "dropped (0)" in result.dropped[
        "host_overhead_s"]
    assert result.hardware.host.host_overhead_s == 0.0
    assert result.values["launch_overhead_s"] == pytest.approx(6e-6, rel=0.1)
    assert all(result.stderr[name] < result.values[name] for name in result.values)


def test_coefficients_the_calls_do_not_depend_on_are_not_determined():
    # an eager decoder on a GPU: the host's launches hide the device's work in every call, so
    # only the overheads move the times
    gpu = CPU.with_terms(**{"overhead_overlaps": True, "memory_bandwidth_bytes_per_s": 1e14,
                                 "peak_flops_per_s": {"fp32": 1e15}, "matmul": None})
    # a GPU has no CPU terms
    truth = gpu.with_terms(**{k: v for k, v in TRUTH.items() if k not in CpuTerms.model_fields
                              and k != "launch_overhead_s"}, launch_overhead_s=3e-4)
    obs = synthetic(truth, noise=0.01)
    assert undetermined(truth, obs, "fp32") >= {"bandwidth_efficiency", "flops_efficiency",
                                                  "kv_bandwidth_efficiency"}
    result = fit(gpu, obs, "fp32")
    for name in ("bandwidth_efficiency", "flops_efficiency", "kv_bandwidth_efficiency"):
        assert "held at its prior" in result.dropped[name], name  # priors, said so
        assert name not in result.values
    assert result.values["launch_overhead_s"] == pytest.approx(3e-4, rel=0.05)
    # two coefficients that only one call depends on: neither is determined, though each moves it
    one = [o for o in synthetic(CPU.with_terms(**TRUTH), noise=0.0)
           if o.record.kind == "coda"][:1]
    loose = undetermined(CPU.with_terms(**TRUTH), one, "fp32", CPU_PARAMETERS)
    assert "matmul_time_scale" in loose and len(loose) >= 2
    # the synthetic CPU calls determine the coefficients the recovery test checks
    assert not undetermined(CPU.with_terms(**TRUTH), synthetic(CPU, noise=0.0),
                            "fp32", CPU_PARAMETERS) & set(TRUTH)


def test_fit_is_robust_to_outliers():
    truth = CPU.with_terms(**TRUTH)
    obs = synthetic(truth, noise=0.005, seed=1)
    for o in obs[::15]:  # a few calls disturbed by another process
        o.seconds *= 5
    result = fit(CPU, obs, "fp32")
    assert result.values["matmul_time_scale"] == pytest.approx(1.3, rel=0.05)


def _profile(**kw) -> CalibrationProfile:
    kw = {"machine": "test", **kw}
    return CalibrationProfile(
        created="2026-11-29T00:00:00+00:00", hardware=CPU, device="cpu",
        torch_version="x", dtype="fp32", commit="abc", models=["huginn-tiny"],
        grid={"positions": [1, 2]}, coefficients={
            p.name: FittedValue(value=1.0, stderr=0.1, unit=p.unit) for p in PARAMETERS},
        fit_stats={"train_points": 3}, **kw)


def test_profile_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    profile = _profile(threads=2, checks=["cache: none"], held={
        "layer_overhead_s": HeldValue(value=0.0, prior=False, reason="fitted at zero")},
        load=LoadReport(measurements=3, retaken_fraction=0.0, loaded_fraction=0.0,
                        canary_tolerance=1.2, canary_median=1.0, canary_p90=1.1))
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


PROFILES = sorted((PROFILES_DIR).glob("*-*-*.json"))
# each committed profile's held-out runs per token, median and max, as docs/calibration.md
# reports them (`costmodel validate --profile FILE`)
PER_TOKEN = {"cpu-huginn-fp32": (0.028, 0.094), "cpu-ouro-fp32": (0.012, 0.018),
             "cpu-huginn-fp32-quick": (0.041, 0.074), "cpu-ouro-fp32-quick": (0.042, 0.049),
             "gpu-huginn-bf16": (0.019, 0.047), "gpu-ouro-bf16": (0.028, 0.074)}


@pytest.mark.parametrize("path", [p for p in PROFILES if not p.name.endswith(".validation.json")],
                         ids=lambda p: p.stem)
def test_committed_profiles_still_predict_their_runs(path):
    """The cost model re-prices the committed profiles' held-out runs as docs/calibration.md
    reports them: a change to the model that moves the calibrated predictions shows here."""
    profile = load_profile(path)
    runs = [p for p in profile.validation if p.kind == "run"]
    errors = [abs(predict_point(p, profile.hardware, profile.dtype) / p.measured_s - 1)
              for p in runs]
    assert len(runs) >= 3
    assert (np.median(errors), max(errors)) == pytest.approx(PER_TOKEN[path.stem], abs=0.0015)
    if profile.device == "cuda":  # eager launches hide the device's work: flops are a prior
        assert profile.held["flops_efficiency"].prior
    else:  # every coefficient a CPU profile keeps has a standard error below its value
        fitted = [c for c in profile.coefficients.values() if not c.unit.endswith("(measured)")]
        assert fitted and all(c.stderr < abs(c.value) for c in fitted)
        assert profile.machine.endswith("CPUs") and profile.load is not None


def test_validate_reports_calls_and_runs_apart(tmp_path):
    """The targets' two figures: the median over the held-out calls, and over the runs' decode
    time per token, each apart from the other."""
    path = PROFILES_DIR / "cpu-ouro-fp32.json"
    args = [sys.executable, "-m", "costmodel", "validate", "--profile", str(path)]
    args += ["--plot", str(tmp_path / "plot.png")]
    out = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for kind, key in (("call", "per_call"), ("run", "per_token")):
        errors = [abs(p["rel_error"]) for p in report["points"] if p["kind"] == kind]
        assert report[key]["points"] == len(errors) > 0
        assert report[key]["median_rel_error"] == pytest.approx(np.median(errors))
        assert report[key]["max_rel_error"] == pytest.approx(max(errors))
    table = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert "runs, per token" in table.stdout and "calls" in table.stdout
    # the shipped profile keeps every held-out measurement: its calls' spread is printed
    assert report["repeat_spread"]["per_call"]["points"] == report["per_call"]["points"]
    assert "measured again" in table.stdout
    # a profile made before repeats_s were kept: no spread is claimed for it
    profile = load_profile(path)
    for point in profile.validation:
        point.repeats_s = None
    save_profile(profile, tmp_path / "old.json")
    args[args.index(str(path))] = str(tmp_path / "old.json")
    old = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(old.stdout)["repeat_spread"] == {"per_call": None, "per_token": None}
    assert "measured again" not in subprocess.run(args, capture_output=True, text=True,
                                                  timeout=60).stdout


def test_validate_reports_how_far_apart_each_points_measurements_ran(tmp_path):
    """The floor under the errors, from the profile itself: each point's slowest measurement
    over its fastest (the calls' two passes, the runs' rounds), as median and max per kind."""
    path = PROFILES_DIR / "cpu-ouro-fp32.json"
    profile = load_profile(path)
    calls = [p for p in profile.validation if p.kind == "call"]
    runs = [p for p in profile.validation if p.kind == "run"]
    spreads = {"call": [0.1 * i for i in range(len(calls))], "run": [0.5] * len(runs)}
    for points, kind in ((calls, "call"), (runs, "run")):
        for point, spread in zip(points, spreads[kind], strict=True):
            point.repeats_s = [point.measured_s * (1 + spread), point.measured_s]
    calls[0].repeats_s = None  # a point measured once counts in neither figure
    save_profile(profile, tmp_path / "p.json")
    args = [sys.executable, "-m", "costmodel", "validate", "--profile", str(tmp_path / "p.json"),
            "--plot", str(tmp_path / "plot.png")]
    out = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spread = json.loads(out.stdout)["repeat_spread"]
    assert spread["per_call"]["points"] == len(calls) - 1
    assert spread["per_call"]["median_spread"] == pytest.approx(np.median(spreads["call"][1:]))
    assert spread["per_call"]["max_spread"] == pytest.approx(spreads["call"][-1])
    assert spread["per_token"] == {"median_spread": pytest.approx(0.5),
                                   "max_spread": pytest.approx(0.5), "points": len(runs)}
    table = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    assert "each held-out point measured again" in table and "50.0% for the runs" in table


def test_predict_says_what_a_profile_does_not_determine():
    gpu = PROFILES_DIR / "gpu-huginn-bf16.json"
    args = [sys.executable, "-m", "costmodel", "predict", "--profile", str(gpu)]
    as_json = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    assert "flops_efficiency" in json.loads(as_json.stdout)["profile_undetermined"]
    table = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "at priors" in table.stderr
    assert "launch_overhead_s" not in table.stderr


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    (b"\x89PNG\r\n\x1a\n", "not valid JSON"),  # a binary file
    ('{"schema_version": 99}', "schema version 99"),
    ('{"schema_version": 3, "hardware": 3}', "corrupt"),
    ('{"schema_version": 4, "hardware": 3}', "corrupt"),
    ('{"schema_version": 3, "hardware": {"overhead_overlaps": false}}', "recalibrate"),
])
def test_bad_profiles_fail_clearly(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProfileError, match=message):
        load_profile(path)
    out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--profile", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_predict_with_a_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPED_DECODING_MACHINE", "Some CPU, 2 CPUs")  # this machine's name
    assert cpu_machine_name() == "Some CPU, 2 CPUs"
    path = tmp_path / "p.json"
    save_profile(_profile(), path)
    out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--profile", str(path),
                          "--model", "huginn-tiny", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["hardware"] == "synthetic cpu"
    # measured on another machine ("test"): said once, on stderr
    assert "was measured on 'test', not this machine ('Some CPU, 2 CPUs')" in out.stderr
    save_profile(_profile(machine="Some CPU, 2 CPUs"), path)
    out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--profile", str(path),
                          "--model", "huginn-tiny"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "measured on" not in out.stderr


def test_the_machine_is_named_from_its_cpu_or_as_the_environment_says(monkeypatch):
    monkeypatch.delenv("LOOPED_DECODING_MACHINE", raising=False)
    own = cpu_machine_name()
    assert own.endswith(f"{len(os.sched_getaffinity(0))} CPUs") and len(own) > len(" CPUs")
    monkeypatch.setenv("LOOPED_DECODING_MACHINE", "  ")  # blank: the CPU's own
    assert cpu_machine_name() == own


SCHEMA3 = Path(__file__).parent / "data" / "gpu-ouro-bf16-schema3.json"


def test_a_schema_3_gpu_profile_converts_and_prices_its_points_as_before():
    """The fixture is a committed schema 3 GPU profile cut to a few points, with what schema 3's
    cost model predicted for each (its validation report): the converted profile predicts the
    same, and holds at priors what the schema 3 fit did not determine."""
    raw = json.loads(SCHEMA3.read_text())
    expected = json.loads(SCHEMA3.with_suffix(".expected.json").read_text())
    profile = load_profile(SCHEMA3)
    assert profile.schema_version == 5 and raw["schema_version"] == 3
    assert {"flops_efficiency", "attention_flops_efficiency"} <= set(profile.held)
    assert "launch_overhead_s" in profile.coefficients
    for point in profile.validation:
        assert predict_point(point, profile.hardware, profile.dtype) == pytest.approx(
            expected[point.label + " " + point.model], rel=1e-9)


SCHEMA4 = Path(__file__).parent / "data" / "cpu-ouro-fp32-schema4.json"


def test_a_schema_4_profile_loads_with_its_hardware_in_parts():
    """The fixture is the committed quick Ouro CPU profile as schema 4 held it (its hardware
    field by field), cut to a few points: it loads as the same spec as the committed schema 5
    profile, so it prices every point to the last digit alike."""
    assert json.loads(SCHEMA4.read_text())["schema_version"] == 4
    old = load_profile(SCHEMA4)
    assert old.schema_version == 5
    assert old.hardware == load_profile(PROFILE_DIR / "cpu-ouro-fp32-quick.json").hardware
    assert old.hardware.cpu is not None and old.hardware.graphs.cuda_graphs is False


@pytest.mark.parametrize("path", [p for p in PROFILES if not p.name.endswith(".validation.json")],
                         ids=lambda p: p.stem)
def test_a_hardware_spec_field_by_field_is_the_same_spec(path):
    hardware = load_profile(path).hardware
    assert HardwareSpec.model_validate(hardware.flat()) == hardware
    assert hardware.flat()["launch_overhead_s"] == hardware.host.launch_overhead_s


def test_a_cpu_term_without_measured_products_is_refused():
    gpu = get_hardware("a6000")
    with pytest.raises(ValueError, match="a CPU term"):
        gpu.with_terms(matmul_time_scale=2.0)
    with pytest.raises(ValueError, match="CPU term"):
        HardwareSpec.model_validate({**gpu.flat(), "attention_key_set_s": 1e-6})
    with pytest.raises(ValueError, match="no term 'bandwidth'"):
        gpu.with_terms(bandwidth=1.0)
    with pytest.raises(ValueError, match="not both"):
        HardwareSpec.model_validate({**gpu.model_dump(), "launch_overhead_s": 1e-6})


def test_a_term_set_by_name_is_validated_as_its_part_validates_it():
    gpu = get_hardware("a6000")
    for term, value in (("memory_bandwidth_bytes_per_s", float("nan")),
                        ("bandwidth_efficiency", 1.5), ("launch_overhead_s", -1e-6)):
        with pytest.raises(ValueError, match=term):  # a copy's update took any of them
            gpu.with_terms(**{term: value})
    assert gpu.with_terms(bandwidth_efficiency=0.5).roofline.bandwidth_efficiency == 0.5


def test_a_busy_calibration_is_refused():
    from calibrate.run import too_busy

    def load(median, p10=None, p90=None):
        return LoadReport(measurements=100, retaken_fraction=0.3, loaded_fraction=0.6,
                          canary_tolerance=1.2, canary_median=median,
                          canary_p90=p90 or 2 * median, canary_p10=p10)

    assert too_busy(None) is None
    # judged by how far apart in speed the measurements ran, not by their level against the
    # fastest canary: steadily 1.8x a burst is one machine, 1.1x to 2.0x is not
    assert too_busy(load(1.8, p10=1.6, p90=2.0)) is None
    message = too_busy(load(1.4, p10=1.1, p90=2.0))
    assert "kept changing" in message and "--force" in message and "1.82x" in message


def test_calibrate_rejects_bad_input(tmp_path):
    for args in (["--model", "llama"], ["--model", "ouro", "--device", "cuda"],
                 ["--model", "ouro", "--dtype", "int4"],
                 ["--model", "ouro", "--checkpoint", str(tmp_path / "none")],
                 ["--model", "ouro", "--acceptances", "0.6,1.2"],
                 ["--model", "ouro", "--acceptances", "high"],
                 ["--model", "ouro", "--threads", "0"],  # 0 was taken as torch's default
                 ["--model", "ouro", "--retries", "-1"]):
        out = subprocess.run([sys.executable, "-m", "costmodel", "calibrate", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1


def test_a_file_that_is_not_a_profile_says_so():
    # a validation report beside its profile said "schema version None ... recalibrate"
    with pytest.raises(ProfileError, match="is not a calibration profile"):
        load_profile(PROFILES_DIR / "gpu-huginn-bf16.validation.json")


def test_calibrate_with_a_checkpoint_of_the_wrong_family(tmp_path):
    from conftest import tiny_model

    from wfd.checkpoint import save

    save(tiny_model("ouro"), tmp_path / "ouro")
    out = subprocess.run([sys.executable, "-m", "costmodel", "calibrate", "--model", "huginn",
                          "--checkpoint", str(tmp_path / "ouro"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not huginn" in out.stderr


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
    import os
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
    back = tmp_path / "back" / "run"
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
    assert profile.hardware.cpu.matmul.seconds == load_profile(machine).hardware.cpu.matmul.seconds


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
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import decode_speed

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
    import os
    import tarfile

    env = {"DEVICE": "cpu", "DTYPE": "fp32", "QUICK": "1", "SIZES": "smallest",
           "RESULTS": str(tmp_path / "run"), "PYTHON": sys.executable, "FAMILIES": "ouro",
           "BENCH": "0", "MACHINE_FROM": str(tmp_path / "missing.json")}
    out = subprocess.run(["bash", "calibrate/gpu.sh"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert out.returncode == 1
    assert "failed steps: ouro eager calibration" in out.stderr
    assert "cannot read profile" in out.stderr and "Traceback" not in out.stderr
    with tarfile.open(tmp_path / "run.tar.gz") as archive:
        assert "run/smoke.json" in archive.getnames()
    spent = subprocess.run(["bash", "calibrate/gpu.sh"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env, "BUDGET_SECONDS": "0"})
    assert spent.returncode == 1 and "SKIPPED: smoke" in spent.stderr
    assert "ouro eager calibration (skipped)" in spent.stderr


def test_machine_measurements_are_reused_only_from_the_same_setting():
    from calibrate.run import reused_peaks
    from wfd.checkpoint import CheckpointError

    path = PROFILES_DIR / "cpu-ouro-fp32-quick.json"
    with pytest.raises(CheckpointError, match="another setting: .*dtype fp32 \\(here bf16\\)"):
        reused_peaks(path, "cpu", "bf16")
    peaks = reused_peaks(path, "cpu", "bf16", force=True)
    source = load_profile(path)
    assert "taken with" in peaks.checks[0]
    assert peaks.matmul.seconds == source.hardware.cpu.matmul.seconds
    # products stream from the copy after the cache knee (kept in the profile, or in one made
    # before it was kept, taken from the knee)
    assert peaks.matmul.streamed_from_bytes == 2 * source.coefficients["cache_knee"].value
    assert peaks.bandwidth_bytes_per_s == load_profile(path).coefficients["peak_bandwidth"].value


def test_decoder_operations_are_counted_per_layer_and_per_part():
    from conftest import TINY_CONFIGS

    from calibrate.operations import count_ops, decoder_operations
    from costmodel.hardware import HardwareSpec
    from wfd.checkpoint import build

    for cfg in TINY_CONFIGS.values():
        models = [build(cfg), build(cfg.model_copy(update={"core_layers": 5}))]
        ops = decoder_operations(models)
        assert 40 < ops.per_layer < 200  # norms, projections, RoPE, cache writes, attention
        # per layer: q, k, v, o and the MLP's products (fused or not), one attention, views
        assert 4 <= ops.layer_by_class["matmul"] <= 8 and ops.layer_by_class["attention"] == 1
        # and kernels: 4 norms, 2 cache writes, 2 residual adds, RoPE, the MLP's activation
        assert ops.layer_by_class["other"] >= 10 and ops.layer_by_class["view"] > 0
        for model in models:  # the count is exactly linear in the layers, class by class
            counts = count_ops(model, "block")
            for kind in HardwareSpec.OPERATION_CLASSES:
                assert counts[kind] == model.config.core_layers * ops.layer_by_class[kind] + \
                    ops.extras_by_class["block"][kind], kind
            assert sum(counts.values()) == model.config.core_layers * ops.per_layer + \
                ops.extras["block"]
        # what a GPU calibration puts in its hardware spec holds together
        HardwareSpec(name="gpu", memory_bandwidth_bytes_per_s=1e12, peak_flops_per_s={"bf16": 1e14},
                     memory_capacity_bytes=1e10, kernels_per_layer=ops.per_layer,
                     part_extra_kernels=ops.extras, layer_operations=ops.layer_by_class,
                     part_extra_operations=ops.extras_by_class,
                     operation_host_weights={"view": 0.3, "other": 1.0})


def test_the_presets_operation_table_is_what_this_decoder_dispatches():
    """costmodel/data/operations.json, which prices a preset's operations, counted again: a
    change to the model code that adds or removes an operation fails here until the table is
    regenerated (the command it names)."""
    from calibrate.operations import family_operations
    from costmodel.specs import decoder_operations

    counted = family_operations("bf16")
    for family in ("huginn", "ouro"):
        assert decoder_operations(family) == counted[family], family


def test_a_cast_to_another_dtype_is_a_kernel_and_a_cast_to_the_same_is_a_view():
    import torch
    from conftest import TINY_CONFIGS

    from calibrate.operations import count_ops
    from wfd.checkpoint import build

    cfg = TINY_CONFIGS["huginn"]
    fp32 = count_ops(build(cfg), "block")
    bf16 = count_ops(build(cfg, dtype=torch.bfloat16), "block")
    # the same operations; in bf16 RoPE's casts to fp32 and back run kernels
    assert sum(bf16.values()) == sum(fp32.values())
    assert bf16["other"] - fp32["other"] == fp32["view"] - bf16["view"] >= 2 * cfg.core_layers


def test_operation_classes_host_weights_are_measured():
    from calibrate.operations import operation_host_weights

    weights = operation_host_weights("cpu", "fp32", calls=50)
    assert set(weights) == {"matmul", "attention", "other", "view"} and weights["other"] == 1.0
    # a view dispatches and allocates nothing: cheaper than a product or an attention
    assert weights["view"] < weights["matmul"] and weights["view"] < weights["attention"]


@pytest.mark.slow
def test_machine_peaks_are_plausible(monkeypatch):
    import calibrate.curve
    import calibrate.machine
    from calibrate.machine import measure_peaks
    from wfd.timing import Quiet

    rows = [1, 2, 4]  # a short curve in one pass (no waiting out load): the test's time
    # the row block read from one small shape (its staircase: a test of its own), not four
    monkeypatch.setattr(calibrate.curve, "ROW_BLOCK_SHAPES", [(512, 512)])
    # a small grid, the same on every machine: copies up to 4 MiB, so the products stream in
    # a working set of 16 MiB whatever cache this CPU has (a 300 MiB cache streams at 1.2 GiB)
    mib = 2.0**20
    monkeypatch.setattr(calibrate.machine, "COPY_WORKING_SETS_BYTES", [mib / 2, mib, 4 * mib])
    monkeypatch.setattr(calibrate.curve, "CURVE_WORKING_SETS_BYTES", [mib])
    monkeypatch.setattr(calibrate.curve, "STREAMED_WORKING_SET_BYTES", 16 * mib)
    sizes = [16 * 1024.0, mib / 4, 4 * mib]
    monkeypatch.setattr(calibrate.curve, "CURVE_SIZES_BYTES", sizes)
    peaks = measure_peaks("cpu", "fp32", quiet=Quiet("cpu", retries=0), curve_rows=rows,
                          curve_passes=1)
    assert peaks.flops_per_s > 1e9 and peaks.bandwidth_bytes_per_s > 1e9
    if peaks.cache_bytes:  # a cache is only one that copies clearly faster than memory
        assert peaks.cache_bandwidth_bytes_per_s >= 1.5 * peaks.bandwidth_bytes_per_s
        # products stream from the next working set copied, the first at memory speed
        larger = [ws for ws, _ in peaks.bandwidth_by_working_set if ws > peaks.cache_bytes]
        assert peaks.matmul.streamed_from_bytes == (min(larger) if larger else None)
    assert peaks.checks[0].startswith("cache:")
    curve = peaks.matmul
    assert curve.rows == rows and curve.matrix_bytes == sizes
    assert curve.working_sets_bytes == [mib, 16 * mib]
    streamed = curve.seconds[-1]
    for line in streamed:  # within what physics allows: no faster than a row, nor a row each
        assert all(0.9 * line[0] <= t <= 1.2 * n * line[0] for n, t in zip(rows, line,
                                                                           strict=True))
    assert len(curve.aspect_seconds) == len(curve.aspects) == 2
    assert streamed[-1][0] > 10 * streamed[0][0]  # a 4 MiB product against a 16 KiB one
    # the kernels' row block (read from a staircase: test_the_row_block_is_read_from_a_
    # staircase_of_times) is said
    assert any(check.startswith("matrix products: ") and "rows" in check
               for check in peaks.checks)


def test_each_curve_point_is_the_median_of_passes_timed_apart():
    """A spell of load slows the lines timed one after another in one pass: the median of the
    passes, a whole pass apart, drops it."""
    from calibrate.curve import median_over_passes

    clock, spell = [0], range(3, 6)  # the 4th to 6th lines timed run slow

    def line(value: float):
        def timed() -> list[float]:
            clock[0] += 1
            return [value * (5.0 if clock[0] - 1 in spell else 1.0)] * 2
        return timed
    lines = [line(float(i + 1)) for i in range(8)]
    assert median_over_passes(lines, 3) == [[float(i + 1)] * 2 for i in range(8)]
    clock[0] = 0
    assert median_over_passes(lines, 1)[4] == [25.0, 25.0]  # one pass keeps the spell


def test_the_cache_is_where_copies_run_clearly_faster_than_memory():
    from calibrate.machine import cache_knee

    mib = 2.0**20
    sets = [(1 * mib, 90e9), (4 * mib, 80e9), (16 * mib, 40e9), (64 * mib, 21e9)]
    assert cache_knee(sets, 20e9) == (16 * mib, 40e9)
    # a VM's "cache" at 28 against 22 GB/s is none
    assert cache_knee([(1 * mib, 28e9), (64 * mib, 22e9)], 22e9) == (0.0, None)


def test_quiet_measures_again_while_the_canary_runs_slow(monkeypatch):
    from wfd.timing import Quiet

    quiet = Quiet("cpu", retries=2, pause_s=0.0)
    ratios = iter([1.0, 2.0, 1.0, 1.0])  # the first attempt ends under load, the second is quiet
    monkeypatch.setattr(quiet, "canary", lambda: next(ratios))
    times = iter([0.5, 0.7])
    assert quiet.measure(lambda t: t, lambda: next(times)) == 0.5  # the faster attempt is kept
    assert quiet.retried == 1
    # a quiet machine measures once; a canary that never settles gives up after the retries
    monkeypatch.setattr(quiet, "canary", lambda: 1.0)
    assert quiet.measure(lambda t: t, lambda: 0.3) == 0.3 and quiet.retried == 1
    monkeypatch.setattr(quiet, "canary", lambda: 3.0)
    calls = iter([0.9, 0.8, 0.85])
    assert quiet.measure(lambda t: t, lambda: next(calls)) == 0.8 and quiet.retried == 2
    # with its time budget spent, a disturbed measurement is kept as it is
    quiet.budget_s = quiet.spent_s
    assert quiet.measure(lambda t: t, lambda: 0.7) == 0.7 and quiet.retried == 2
    report = quiet.report()  # four measurements, three kept under load (2.0x and 3.0x)
    assert report["measurements"] == 4 and report["loaded_fraction"] == 0.75
    assert report["retaken_fraction"] == 0.5 and report["canary_p90"] == 3.0
    assert report["canary_p10"] == 1.0  # the quiet one


def test_the_canary_reports_its_time_over_the_fastest_so_far(monkeypatch):
    import wfd.timing as timing

    quiet = timing.Quiet("cpu")
    times = iter([0.010, 0.020, 0.015, 0.005, 0.010])
    monkeypatch.setattr(timing, "_best_time", lambda *args, **kw: next(times))
    assert [quiet.canary() for _ in range(5)] == pytest.approx([1.0, 2.0, 1.5, 1.0, 2.0])


def test_a_run_counts_each_call_at_the_median_of_its_shape():
    from calibrate.measure import RunSample
    from calibrate.validate import run_point

    def call(kind, position, wall_s):
        return CallRecord(kind=kind, positions=[position], depths=[1], contexts=[position + 1],
                          slots=[0], wall_s=wall_s)

    prompt = 4
    records = [call("block", p, 0.010) for p in range(prompt)]  # the prefill's
    for token in range(4):  # four decoded positions, two block calls each; one call spikes
        records += [call("block", prompt + token, 0.050 if token == 2 else 0.020),
                    call("block", prompt + token, 0.020), call("coda", prompt + token, 0.005)]
    calls_s = sum(r.wall_s for r in records)
    run = RunSample(model="m", schedule="ar", draft_depth=None, block_length=None, tokens=5,
                    wall_s=calls_s + 0.004, records=records, accept=[])
    point = run_point("m", get_model("huginn-tiny"), run, prompt, depth=2)
    assert point.wall_per_token_s == pytest.approx((calls_s + 0.004 - 0.040) / 4)
    # the spike counts at the median (0.020 s); the 4 ms outside the calls stays
    assert point.measured_s == pytest.approx((8 * 0.020 + 4 * 0.005 + 0.004) / 4)


def test_calibrate_refuses_a_busy_machines_profile_unless_forced(monkeypatch, tmp_path, capsys):
    import calibrate.run
    from costmodel import cli

    quiet_profile = load_profile(PROFILES_DIR
                                 / "cpu-ouro-fp32-quick.json")
    busy = quiet_profile.model_copy(update={"load": LoadReport(
        measurements=100, retaken_fraction=0.4, loaded_fraction=0.9, canary_tolerance=1.2,
        canary_median=2.2, canary_p90=3.0, canary_p10=1.2)})
    monkeypatch.setattr(calibrate.run, "calibrate", lambda *args, **kw: busy.model_copy())
    out = tmp_path / "p.json"

    def calibrate_cmd(*extra: str) -> int:
        monkeypatch.setattr(sys, "argv", ["costmodel", "calibrate", "--model", "ouro", "--out",
                                          str(out), "--json", *extra])
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        return exit_.value.code

    assert calibrate_cmd() == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kept changing" in err[0] and "--force" in err[0]
    assert calibrate_cmd("--force") == 0
    assert load_profile(out).load.forced  # written, flagged


PROFILE_DIR = PROFILES_DIR


def _tiny_calls_profile(scale: float) -> CalibrationProfile:
    """The committed quick Huginn profile cut to the tiny model's calls, its stored times
    multiplied by ``scale``."""
    prof = load_profile(PROFILE_DIR / "cpu-huginn-fp32-quick.json")

    def scaled(points):
        return [p.model_copy(update={"measured_s": p.measured_s * scale,
                                     "repeats_s": [t * scale for t in p.repeats_s or []]})
                for p in points if p.kind == "call" and p.model == "huginn-tiny"]

    return prof.model_copy(update={"models": ["huginn-tiny"], "training": scaled(prof.training),
                                   "validation": scaled(prof.validation)})


def test_a_profile_check_times_each_models_fastest_and_slowest_call():
    from calibrate.check import call_points, sample_calls

    prof = load_profile(PROFILE_DIR / "cpu-huginn-fp32-quick.json")
    chosen = sample_calls(prof, 8)
    assert [p.model for p in chosen] == [m for m in prof.models for _ in range(2)]
    for model in prof.models:
        times = [p.measured_s for p in call_points(prof) if p.model == model]
        assert {p.measured_s for p in chosen if p.model == model} == {min(times), max(times)}
    assert len(sample_calls(prof, 3)) == 3 and len(sample_calls(prof, 10_000)) == len(
        call_points(prof))


def test_a_profile_holds_while_its_calls_run_near_their_stored_times():
    from calibrate.check import CheckedCall, ProfileCheck

    def check(*ratios: float) -> ProfileCheck:
        return ProfileCheck(machine="m", profile_machine="m", threads=2, tolerance=0.1,
                            profile_repeat_spread=0.03,
                            calls=[CheckedCall(label="c", model="x", profile_s=1.0, now_s=r)
                                   for r in ratios])

    assert check(1.05, 0.7, 1.3).holds and check(0.92).holds
    # slower or faster by more than the tolerance, either way
    assert not check(1.2).holds and not check(0.85).holds
    assert check(1.2, 1.3, 0.5).median_ratio == 1.2


@pytest.mark.slow
def test_checking_a_profile_on_a_machine_that_is_not_its_own(tmp_path, capsys):
    """Stored times a thousand times too short: no machine runs them, the check says the
    profile does not hold (exit 1), by about that factor, and says how to fix it."""
    from conftest import run_cli

    path = tmp_path / "p.json"
    save_profile(_tiny_calls_profile(1e-3), path)
    out = subprocess.run([sys.executable, "-m", "costmodel", "check-profile", "--profile",
                          str(path), "--calls", "1", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    result = json.loads(out.stdout)
    assert not result["holds"] and len(result["calls"]) == 1
    assert result["median_ratio"] > 100  # about a thousand, or more on a busy machine
    assert result["per_model"].keys() == {"huginn-tiny"}
    # the same as a table (in this process: the interpreter and torch already started)
    code, text, _ = run_cli(capsys, "check-profile", "--profile", str(path), "--calls", "1")
    assert code == 1
    assert "does not hold" in text and "costmodel calibrate --model huginn" in text


def test_checking_a_profile_rejects_what_it_cannot_time(tmp_path):
    path = tmp_path / "p.json"
    prof = _tiny_calls_profile(1.0)
    gone = prof.model_copy(update={"training": [p.model_copy(update={"model": "/no/such/model"})
                                                for p in prof.training], "validation": []})
    cases = [(["--profile", str(PROFILE_DIR / "cpu-huginn-fp32-quick.json"), "--calls", "0"],
              "at least 1"),
             (["--profile", str(PROFILE_DIR / "gpu-huginn-bf16.json")], "no CUDA device"),
             (["--profile", str(path)], "/no/such/model")]
    save_profile(gone, path)
    for args, message in cases:
        out = subprocess.run([sys.executable, "-m", "costmodel", "check-profile", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
