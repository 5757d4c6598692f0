"""`--schedule auto` on a machine nobody calibrated: a committed profile rescaled to it from a few
of the model's own calls, kept in the user's cache and reused."""

import os
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from costmodel import get_hardware
from costmodel.cost import call_cost
from costmodel.profile import load_profile
from costmodel.store import PROFILES_DIR
from wfd.transplant import SHAPES, factors, profile_for

PROFILES = PROFILES_DIR


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """This process on a machine of another name, its cache in a folder of the test's."""
    monkeypatch.setenv("LOOPED_DECODING_MACHINE", "Another CPU, 2 CPUs")
    monkeypatch.setenv("LOOPED_DECODING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_machine_nobody_calibrated_gets_a_profile_in_seconds_kept_for_later_runs(elsewhere):
    model, said = tiny_model("huginn"), []
    source, profile = profile_for(model, "tiny-test", "cpu", say=said.append)
    assert said == [f"auto: no calibration of this machine (Another CPU, 2 CPUs); timing "
                    f"{len(SHAPES)} calls of tiny-test to rescale AMD EPYC, 2 CPUs's profile"]
    assert Path(source).parent == elsewhere / "profiles" and Path(source).is_file()
    assert profile.machine == "Another CPU, 2 CPUs" and profile.models == ["tiny-test"]
    assert profile.checks[0].startswith("transplanted: AMD EPYC, 2 CPUs's profile")
    assert len(profile.validation) == len(SHAPES)  # its own calls, for a later check
    assert load_profile(source).hardware == profile.hardware
    said.clear()
    again_source, again = profile_for(model, "tiny-test", "cpu", say=said.append)
    assert (again_source, again.hardware, said) == (source, profile.hardware, [])
    # an hour on, the kept profile's calls are timed again before it is trusted
    os.utime(source, (time.time() - 7200, time.time() - 7200))
    checked_source, checked = profile_for(model, "tiny-test", "cpu", say=said.append)
    assert checked_source == source and checked.machine == "Another CPU, 2 CPUs"
    assert time.time() - Path(source).stat().st_mtime < 600  # checked (or remade) just now


def test_a_cache_that_cannot_be_written_is_said_in_a_line_and_auto_still_decides(
        elsewhere, monkeypatch):
    elsewhere.parent.mkdir(exist_ok=True)
    elsewhere.write_text("a file where the cache folder would be")
    said = []
    source, profile = profile_for(tiny_model("ouro"), "tiny-test", "cpu", say=said.append)
    assert len(said) == 2 and said[1].startswith(f"auto: cannot keep this machine's profile in "
                                                 f"{elsewhere / 'profiles'}")
    assert source == "this machine's calls, timed just now"
    assert profile.machine == "Another CPU, 2 CPUs"


def test_a_dtype_nobody_calibrated_says_which_calibration_to_make():
    # the fp32 profile of this machine was taken for a bf16 run: "no peak flops for bf16"
    from wfd.runtime import GenerationError

    model = tiny_model("huginn").to(torch.bfloat16)
    with pytest.raises(GenerationError, match="in bf16 on a cpu .* --dtype bf16"):
        profile_for(model, "tiny-test", "cpu", say=lambda line: None)


def test_the_two_factors_are_read_back_from_calls_that_weigh_them_differently():
    """Calls that ran twice the profile's host time and half its device time give back 2 and
    0.5, whatever their shapes' mix of the two (within the gentle hold at their overall
    ratio)."""
    from wfd.transplant import _split

    profile = load_profile(PROFILES / "cpu-huginn-fp32-quick.json")
    points = [p for p in profile.validation if p.kind == "call"]
    assert len({round(h / (h + d), 2) for h, d in (_split(profile, p) for p in points)}) > 3
    for point in points:
        host, device = _split(profile, point)
        point.measured_s = 2 * host + 0.5 * device
    assert factors(profile, points) == pytest.approx((2.0, 0.5), rel=0.05)


def test_a_faster_device_moves_the_devices_time_and_leaves_the_hosts():
    hw = get_hardware("a6000").with_terms(**{"overhead_overlaps": False})
    model = tiny_model("ouro").config.to_spec("t")
    part = model.part("block")

    def cost(h):
        return call_cost(model, h, part, "bf16", n_positions=1, n_slots=1,
                         context_sum_positions=512, context_sum_slots=512)

    slow, fast = cost(hw), cost(hw.with_device_speed(2.0))
    assert fast.overhead_s == pytest.approx(slow.overhead_s)
    assert fast.time_s - fast.overhead_s == pytest.approx((slow.time_s - slow.overhead_s) / 2)
    with pytest.raises(ValueError, match="positive factor"):
        hw.with_device_speed(0)
