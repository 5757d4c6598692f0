"""A GPU's two execution modes fitted together: calls drawn from a known hardware in eager mode
(host-bound) and graphs mode (device-bound) recover it, shared device coefficients and each
mode's host terms; fitted on one mode alone, the other mode's calls show what it missed."""

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_cli

import calibrate.modes
from calibrate.fit import MODE_TERMS, Observation, fit, parameters_for, predict_calls
from calibrate.modes import join_modes
from costmodel import get_model
from costmodel.cost import call_cost
from costmodel.hardware import HardwareSpec
from costmodel.profile import (
    CalibrationProfile,
    ProfileError,
    ValidationPoint,
    load_profile,
    save_profile,
)
from costmodel.schedules import AR, WFD
from costmodel.simulate import simulate
from costmodel.trace import CallRecord

GPU = HardwareSpec(name="synthetic gpu", memory_bandwidth_bytes_per_s=3e12,
                   peak_flops_per_s={"fp32": 6e13}, memory_capacity_bytes=80e9,
                   overhead_overlaps=True, attention_split_by_slot=False,
                   kernels_per_layer=14, attention_kernels_per_slot=0)
DEVICE = {"bandwidth_efficiency": 0.6, "kv_bandwidth_efficiency": 0.5, "flops_efficiency": 0.5,
          "attention_flops_efficiency": 0.15, "kernel_device_s": 2.5e-6}
# the attention's host cost by shape, as the H200's eager calls show it (docs/calibration.md)
EAGER = {"host_overhead_s": 150e-6, "launch_overhead_s": 8e-6,
         "attention_one_set_host_s": 40e-6, "attention_grouped_host_s": 60e-6}
GRAPHS = {"graph_host_overhead_s": 120e-6, "graph_launch_overhead_s": 0.0}
TRUTH = GPU.with_terms(**{**DEVICE, **EAGER, **GRAPHS})


def calls(mode: str, noise: float, seed: int, truth: HardwareSpec = TRUTH) -> list[Observation]:
    rng = np.random.default_rng(seed)
    obs = []
    for preset in ("huginn-tiny", "huginn-mid", "huginn-base", "ouro-mid"):
        spec = get_model(preset)
        for n in (1, 4, 16, 256):
            for ctx in (64, 4096):
                positions = list(range(ctx, ctx + n))
                # a DtV-like call (one slot) and, over a few positions at the short context, a
                # wave (a slot each: host-bound in eager mode, as on the H200)
                wave = 1 < n <= 16 and ctx == 64
                for slots in [[0] * n] + ([list(range(n))] if wave else []):
                    rec = CallRecord(kind="block", positions=positions, depths=[1] * n,
                                     contexts=[p + 1 for p in positions], slots=slots)
                    obs.append(Observation(spec, rec, 0.0, mode))
        obs.append(Observation(spec, CallRecord(kind="coda", positions=[64], depths=[4],
                                                contexts=[65], slots=[3]), 0.0, mode))
        obs.append(Observation(spec, CallRecord(kind="prelude", positions=[64], depths=[0],
                                                contexts=[65], slots=[0]), 0.0, mode))
    times = predict_calls(truth, obs, "fp32") * np.exp(rng.normal(0, noise, len(obs)))
    for o, t in zip(obs, times, strict=True):
        o.seconds = float(t)
    return obs


def test_the_modes_price_host_and_device_apart():
    spec = get_model("huginn-mid")
    part = spec.part("block")
    eager = call_cost(spec, TRUTH, part, "fp32", n_positions=1, n_slots=1,
                      context_sum_positions=64, context_sum_slots=64)
    graphs = call_cost(spec, TRUTH.in_mode("graphs"), part, "fp32", n_positions=1, n_slots=1,
                       context_sum_positions=64, context_sum_slots=64)
    host = 150e-6 + part.layers * 40e-6 + eager.kernels * 8e-6  # one key set
    assert float(eager.time_s) == pytest.approx(host)  # eager: host-bound
    roofline = float(graphs.weights_s + graphs.kv_s + graphs.compute_s)
    assert float(graphs.time_s) == pytest.approx(roofline + graphs.kernels * 2.5e-6)
    # the attention's shape: a verification (4 queries, one key set) pays both terms, a wave
    # (4 queries, a key set each) neither, nor does a batch of 4 one-position calls
    def eager_s(n, slots, key_sets=None):
        return float(call_cost(spec, TRUTH, part, "fp32", n_positions=n, n_slots=slots,
                               context_sum_positions=64 * n, context_sum_slots=64 * slots,
                               key_sets=key_sets).time_s)  # host-bound: the host's time

    base = eager_s(4, 4)
    assert eager_s(4, 1) - base == pytest.approx(part.layers * 100e-6)
    assert eager_s(4, 1, key_sets=4) == pytest.approx(base)
    # the host speed scales the graphs host term too, and never the device's
    fast = TRUTH.with_host_speed(4.0)
    assert fast.graphs.graph_host_overhead_s == 30e-6 and fast.roofline.kernel_device_s == 2.5e-6


def test_one_fit_over_both_modes_recovers_every_coefficient_it_can_see():
    obs = calls("eager", 0.01, 0) + calls("graphs", 0.01, 1)
    result = fit(GPU, obs, "fp32")
    assert {p.name for p in parameters_for(GPU, ["eager", "graphs"])} >= set(DEVICE) | set(
        MODE_TERMS["eager"]) | set(MODE_TERMS["graphs"])
    for name, value in {**DEVICE, **EAGER, **GRAPHS}.items():
        # not in the truth: dropped, or worth less than the calls' noise (1%, 3 sigma) on any call
        if value == 0.0:
            without = predict_calls(result.hardware.with_terms(**{name: 0.0}), obs, "fp32")
            worth = np.abs(predict_calls(result.hardware, obs, "fp32") / without - 1)
            assert name in result.dropped or worth.max() < 0.03, name
        else:
            assert result.values[name] == pytest.approx(value, rel=0.1), name
            assert result.stderr[name] < 0.3 * value, name
    assert np.median(np.abs(result.residuals)) < 0.02


def test_an_eager_fit_alone_misses_the_device():
    """Eager calls are host-bound but for the largest: they pin the host's terms, leave the KV
    bandwidth undetermined and the graphs host terms at their priors, so the same hardware in
    graphs mode misprices the graphs calls whose host time shows."""
    result = fit(GPU, calls("eager", 0.01, 0), "fp32")
    assert not set(result.values) & set(MODE_TERMS["graphs"])  # not fitted, kept as they were
    assert "kv_bandwidth_efficiency" in result.dropped
    assert result.values["launch_overhead_s"] == pytest.approx(8e-6, rel=0.05)
    graphs = calls("graphs", 0.0, 1)
    errors = predict_calls(result.hardware, graphs, "fp32") / [o.seconds for o in graphs] - 1
    assert np.max(np.abs(errors)) > 0.3  # its graphs host terms are priors


@functools.cache
def _profile(mode: str, seed: int) -> CalibrationProfile:
    def point(o: Observation) -> ValidationPoint:
        return ValidationPoint(kind="call", model=o.model.name, spec=o.model, label="call",
                               group=o.record.kind, measured_s=o.seconds, record=o.record)

    obs = calls(mode, 0.01, seed)
    spec = get_model("huginn-mid")
    runs = []
    for schedule in (AR(), WFD(draft_depth=4)):
        accept = [i % 7 != 0 for i in range(48)]
        res = simulate(spec, TRUTH.in_mode(mode), schedule, context_length=64, new_tokens=24,
                       accept_sequence=accept, dtype="fp32")
        runs.append(ValidationPoint(kind="run", model="huginn-mid", spec=spec,
                                    label=schedule.kind, group=schedule.kind,
                                    measured_s=res.latency_per_token_s, prompt_length=64,
                                    tokens=24, accept=accept,
                                    draft_depth=getattr(schedule, "draft_depth", None)))
    train = [o for o in obs if len(o.record.positions) != 4]  # held out: 4 positions a call
    # (join-modes refits from the priors: the profile's own fit does not matter here)
    return CalibrationProfile(
        created="2026-12-01T00:00:00+00:00", hardware=GPU.in_mode(mode), machine="gpu",
        device="cuda", torch_version="x", dtype="fp32", commit="abc", models=["huginn-mid"],
        grid={"positions": [1, 4, 16, 256]}, coefficients={}, fit_stats={"train_points": 0},
        training=[point(o) for o in train],
        validation=[point(o) for o in obs if o not in train] + runs)


@pytest.mark.slow
def test_joined_profiles_validate_per_mode_and_across_modes(tmp_path, capsys, monkeypatch):
    eager, graphs = tmp_path / "eager.json", tmp_path / "graphs.json"
    save_profile(_profile("eager", 0), eager)
    save_profile(_profile("graphs", 1), graphs)
    joint = tmp_path / "joint.json"
    cli = [sys.executable, "-m", "costmodel"]
    out = subprocess.run([*cli, "join-modes", str(eager), str(graphs), "--out", str(joint),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["coefficients"]["kernel_device_s"]["value"] == pytest.approx(2.5e-6, rel=0.1)
    assert payload["coefficients"]["launch_overhead_s"]["value"] == pytest.approx(8e-6, rel=0.1)
    cross = {(c["fit_on"], c["predicted"]): c for c in payload["cross_mode"]}
    assert set(cross) == {("eager", "graphs"), ("graphs", "eager")}
    assert "graph_host_overhead_s" in cross["eager", "graphs"]["held"]
    # the same as text, in this process, from the fit just written (fitting again takes 5 s)
    monkeypatch.setattr(calibrate.modes, "join_modes", lambda e, g: load_profile(joint))
    code, text, _ = run_cli(capsys, "join-modes", str(eager), str(graphs), "--out",
                            str(tmp_path / "again.json"))
    assert code == 0
    c = cross["eager", "graphs"]["per_call"]
    assert (f"fitted on eager only, priced graphs: calls median {c['median_rel_error']:.1%}, "
            f"max {c['max_rel_error']:.1%}") in text

    rep = subprocess.run([*cli, "validate", "--profile", str(joint), "--plot",
                          str(tmp_path / "v.png"), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    for mode in ("eager", "graphs"):  # the joint fit prices each mode's held-out points
        figures = report["per_mode"][mode]
        assert figures["per_call"]["median_rel_error"] < 0.03, mode
        assert figures["per_token"]["max_rel_error"] < 0.05, mode
        assert figures["per_call"]["max_rel_error"] < 0.06, mode
    # fitted on one mode alone, the other's host terms are priors and the device's bandwidths
    # are loose: the other mode's calls show it
    for pair in cross:
        assert cross[pair]["per_call"]["max_rel_error"] > 0.3, pair
    table = subprocess.run([*cli, "validate", "--profile", str(joint), "--plot",
                            str(tmp_path / "v.png")], capture_output=True, text=True, timeout=120)
    assert "eager only" in table.stdout and "graphs only" in table.stdout
    # predict reads both modes from the one fit
    for mode in ("eager", "graphs"):
        pred = subprocess.run([*cli, "predict", "--profile", str(joint), "--model",
                               "huginn-mid", "--mode", mode, "--dtype", "fp32", "--json"],
                              capture_output=True, text=True, timeout=120)
        assert pred.returncode == 0, pred.stderr
        assert json.loads(pred.stdout)["mode"] == mode


def test_join_modes_refuses_a_pair_that_is_not_one_gpu_in_two_modes(tmp_path):
    eager = _profile("eager", 0)
    with pytest.raises(ProfileError, match="one eager and one graphs"):
        join_modes(eager, eager)
    with pytest.raises(ProfileError, match="differ in dtype"):
        join_modes(eager, _profile("graphs", 1).model_copy(update={"dtype": "bf16"}))
    path = tmp_path / "e.json"
    save_profile(eager, path)
    out = subprocess.run([sys.executable, "-m", "costmodel", "join-modes", str(path), str(path),
                          "--out", str(tmp_path / "j.json")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "one eager and one graphs" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "j.json").exists()


def test_refit_brings_an_older_profile_to_this_cost_model(tmp_path):
    """A profile whose fit predates a term (here: no fit at all, the spec's defaults) is fitted
    again from its stored calls: the attention's host cost by shape comes back, its held-out
    calls are priced as well as a fresh calibration's, and the measurements stay."""
    old = tmp_path / "old.json"
    save_profile(_profile("eager", 0), old)
    new = tmp_path / "new.json"
    cli = [sys.executable, "-m", "costmodel", "refit", str(old), "--out", str(new), "--json"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    for name in ("attention_one_set_host_s", "attention_grouped_host_s"):
        assert payload["coefficients"][name]["value"] == pytest.approx(EAGER[name], rel=0.15)
    assert "kernel_device_s" in payload["held"]  # eager calls cannot see it
    assert payload["after"]["per_call"]["median_rel_error"] < 0.03
    assert payload["before"]["per_call"]["median_rel_error"] > 0.1
    refitted = CalibrationProfile.model_validate_json(new.read_text())
    assert refitted.training == _profile("eager", 0).training
    bandwidth = refitted.hardware.roofline.memory_bandwidth_bytes_per_s
    assert bandwidth == GPU.roofline.memory_bandwidth_bytes_per_s
    assert any(check.startswith("refitted ") for check in refitted.checks)

    empty = tmp_path / "empty.json"
    save_profile(_profile("eager", 0).model_copy(update={"training": []}), empty)
    bad = subprocess.run([sys.executable, "-m", "costmodel", "refit", str(empty), "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no training calls" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x.json").exists()


# the dispatched operations by class, as a GPU calibration counts them (Ouro-like: a prelude and
# a coda of a few operations with their own mix), and each class's host time
CLASSES = {"kernels_per_layer": 83, "part_extra_kernels": {"prelude": 22, "block": 27, "coda": 21},
           "layer_operations": {"matmul": 7, "attention": 1, "other": 40, "view": 35},
           "part_extra_operations": {"prelude": {"other": 11, "view": 11},
                                     "block": {"other": 16, "view": 11},
                                     "coda": {"matmul": 1, "other": 10, "view": 10}},
           "operation_host_weights": {"matmul": 1.8, "attention": 3.0, "other": 1.0,
                                      "view": 0.35}}


def test_operation_classes_weigh_the_host_and_views_launch_nothing():
    truth = TRUTH.with_terms(**CLASSES)
    spec = get_model("ouro-mid")
    coda = call_cost(spec, truth, spec.part("coda"), "fp32", n_positions=1, n_slots=1,
                     context_sum_positions=64, context_sum_slots=64)
    assert spec.part("coda").layers == 0 and float(coda.kernels) == 21 - 10
    assert float(coda.time_s) == pytest.approx(150e-6 + 8e-6 * (1.8 + 10 + 10 * 0.35))
    block = spec.part("block")
    graphs = call_cost(spec, truth.in_mode("graphs"), block, "fp32", n_positions=1, n_slots=1,
                       context_sum_positions=64, context_sum_slots=64)
    assert float(graphs.kernels) == block.layers * (83 - 35) + 27 - 11  # what a graph replays
    with pytest.raises(ValueError, match="sum to 82, not its 83"):
        HardwareSpec.model_validate({**truth.flat(), "layer_operations": {"other": 47, "view": 35}})


def test_a_fit_that_weighs_operations_alike_misprices_the_small_calls():
    """With the classes counted and weighed, the fit recovers the host per operation and prices
    every call; weighing every operation alike, the prelude and coda (few operations, another
    mix than the layers') are mispriced beyond the calls' noise (1%: 3 sigma). A small host
    time per call, as Ouro's on the H200: the operations dominate those calls."""
    truth = TRUTH.with_terms(**{**CLASSES, "host_overhead_s": 20e-6})
    # the host-bound calls (the 256-position ones show the device, which this is not about)
    obs = [o for o in calls("eager", 0.01, 0, truth) if len(o.record.positions) <= 16]
    counted = {k: CLASSES[k] for k in ("kernels_per_layer", "part_extra_kernels")}
    weighed = fit(GPU.with_terms(**CLASSES), obs, "fp32")
    alike = fit(GPU.with_terms(**counted), obs, "fp32")
    assert weighed.values["launch_overhead_s"] == pytest.approx(8e-6, rel=0.1)
    small = [i for i, o in enumerate(obs) if o.record.kind in ("prelude", "coda")]
    assert np.max(np.abs(weighed.residuals[small])) < 0.03
    assert np.max(np.abs(alike.residuals[small])) > 0.03


def test_an_eager_refit_keeps_the_replay_microbenchmarks_for_graphs_mode():
    """An eager fit cannot see a replayed call's host cost nor the device's per kernel: the
    profile's replay microbenchmarks are where a graphs-mode prediction starts from."""
    from calibrate.refit import refit
    from costmodel.profile import FittedValue

    measured = {"replay_host_s": FittedValue(value=33e-6, stderr=0.0, unit="s (measured)"),
                "replay_kernel_device_s": FittedValue(value=1.7e-6, stderr=0.0,
                                                      unit="s (measured)")}
    profile = _profile("eager", 0).model_copy(update={"coefficients": measured})
    hw = refit(profile).hardware
    assert hw.graphs.graph_host_overhead_s == 33e-6 and hw.roofline.kernel_device_s == 1.7e-6
    assert refit(_profile("eager", 0)).hardware.roofline.kernel_device_s == 2e-6  # none: the prior


def test_a_gpu_calibration_starts_from_the_replay_microbenchmarks_given_once():
    """The per-kernel device time has a prior and a microbenchmark: the calibration's spec
    takes the measured one (a GPU calibration used to pass both, and could not start)."""
    from calibrate.fit import prior
    from calibrate.run import starting_terms
    from costmodel.hardware import HardwareSpec

    measured = starting_terms(True, {"replay_host_s": 33e-6, "replay_kernel_device_s": 1.7e-6})
    assert measured == {"kernel_device_s": 1.7e-6, "graph_host_overhead_s": 33e-6}
    hw = HardwareSpec(name="gpu", memory_bandwidth_bytes_per_s=1e12,
                      peak_flops_per_s={"bf16": 1e14}, memory_capacity_bytes=1e10, **measured)
    assert hw.roofline.kernel_device_s == 1.7e-6 and hw.graphs.graph_host_overhead_s == 33e-6
    assert starting_terms(True, {}) == {"kernel_device_s": prior("kernel_device_s")}
    assert starting_terms(False, {}) == {"kernel_device_s": 0.0}


def test_the_replay_microbenchmark_times_a_call_and_its_kernels():
    from calibrate.operations import graph_replay_costs

    per_call, per_kernel = graph_replay_costs("cpu", kernels=16, replays=20, capture=False)
    assert 0 < per_call < 1e-2 and 0 <= per_kernel < per_call
