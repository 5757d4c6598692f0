"""Calibration: the fit recovers known coefficients, profiles round-trip, bad profiles fail
clearly, and the whole pipeline runs end to end on tiny models."""

import json
import os
import subprocess
import sys
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
    assert old.hardware == load_profile(PROFILES_DIR / "cpu-ouro-fp32-quick.json").hardware
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
