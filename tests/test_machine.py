"""What a calibration measures of the machine (its peaks, the decoder's operations, a quiet
machine) and how a profile is checked again on it (check-profile)."""

import json
import subprocess
import sys

import pytest

from costmodel import get_model
from costmodel.hardware import HardwareSpec
from costmodel.profile import (
    CalibrationProfile,
    LoadReport,
    load_profile,
    save_profile,
)
from costmodel.store import PROFILES_DIR
from costmodel.trace import CallRecord


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
    # timed once (--retries 0): a thousandfold miss needs no quiet machine to show
    args = ["check-profile", "--profile", str(path), "--calls", "1", "--retries", "0"]
    out = subprocess.run([sys.executable, "-m", "costmodel", *args, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    result = json.loads(out.stdout)
    assert not result["holds"] and len(result["calls"]) == 1
    assert result["median_ratio"] > 100  # about a thousand, or more on a busy machine
    assert result["per_model"].keys() == {"huginn-tiny"}
    # the same as a table (in this process: the interpreter and torch already started)
    code, text, _ = run_cli(capsys, *args)
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
