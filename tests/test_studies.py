"""Every study runs on a small grid, writes its outputs, and agrees with direct predictions."""

import importlib
import json
import subprocess
import sys

import pytest

import studies
from costmodel import Workload, get_hardware, get_model, predict
from costmodel.profile import load_profile
from costmodel.slots import mean_decode_keys
from costmodel.store import PROFILES_DIR
from studies.common import to_csv, to_markdown
from studies.paper_table import derive_overhead, derived_hardware


@pytest.mark.parametrize("name", list(studies.STUDIES))
def test_each_study_runs_and_writes_table_and_figure(name, tmp_path):
    result, paths = studies.run(name, out=tmp_path, small=True)
    assert result.rows
    for kind in ("csv", "markdown", "figure"):
        assert (tmp_path / paths[kind].split("/")[-1]).stat().st_size > 0
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def by(rows, *keys):
    """The rows grouped by the values of ``keys``."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return groups


def rising(values) -> bool:
    return all(a < b for a, b in zip(values, values[1:], strict=False))


def test_dtv_block_length_study_marks_the_fastest_k_and_gains_with_acceptance():
    result, _ = studies.run("dtv-block-length", small=True)
    for rows in by(result.rows, "acceptance").values():
        (best,) = [r for r in rows if r["best_k"]]  # one per acceptance
        assert best["dtv_speedup"] == max(r["dtv_speedup"] for r in rows)
        assert len({r["wfd_speedup"] for r in rows}) == 1  # WFD has no k
    for rows in by(result.rows, "block_length").values():
        assert rising([r["dtv_speedup"] for r in sorted(rows, key=lambda r: r["acceptance"])])
    # WFD ahead of DtV's best at each acceptance
    assert all(r["wfd_speedup"] > r["dtv_speedup"] for r in result.rows if r["best_k"])


def test_width_study_gains_with_acceptance_and_drafts_at_ceil_r_over_w():
    width, _ = studies.run("width", small=True)
    for (model, _, w), rows in by(width.rows, "model", "hardware", "width").items():
        rows = sorted(rows, key=lambda r: r["acceptance"])
        assert rising([r["wfd_speedup"] for r in rows])
        depth = get_model(model).default_depth
        assert {r["draft_depth"] for r in rows} == {-(-depth // w)}
        # every draft accepted: one position enters every d ticks, a block call a tick
        full = [r for r in rows if r["acceptance"] == 1.0]
        assert all(r["block_calls_per_token"] == pytest.approx(r["draft_depth"]) for r in full)


def test_hardware_study_ranks_the_schedules_and_its_times_make_its_speedups():
    hw, _ = studies.run("hardware", small=True)
    for row in hw.rows:
        assert row["ar_speedup"] == 1.0
        assert row["wfd_speedup"] > row["dtv_speedup"] > 1
        for kind in ("dtv", "wfd"):
            assert row[f"{kind}_speedup"] == pytest.approx(
                row["ar_ms_per_token"] / row[f"{kind}_ms_per_token"])
    # a bandwidth-bound device with a fast host, and a host-bound stack, both show up
    assert {r["ar_bound"] for r in hw.rows} >= {"bandwidth", "overhead"}


def test_context_and_memory_studies_fit_longer_sequences_with_fewer_kv_slots():
    ctx, _ = studies.run("context", small=True)
    for rows in by(ctx.rows, "model", "context").values():
        longest = {r["kv_sharing"]: r["max_context"] for r in rows}
        assert longest[1] >= longest[4] >= longest[0]  # fewer slots, longer sequences
        for row in rows:
            assert row["fits"] == (row["context"] + 512 <= row["max_context"])
            assert (row["wfd_speedup"] is None) == (not row["fits"])
    mem, _ = studies.run("memory", small=True)
    for row in mem.rows:
        assert (row["max_context_kv_1_shared"] > row["max_context_kv_4_shared"]
                >= row["max_context_kv_per_depth"])
    # a device with more memory fits longer sequences of the same model
    for rows in by(mem.rows, "model").values():
        capacity = {r["hardware"]: get_hardware(r["hardware"]).roofline.memory_capacity_bytes
                    for r in rows}
        ordered = sorted(rows, key=lambda r: capacity[r["hardware"]])
        assert [r["max_context_kv_per_depth"] for r in ordered] == sorted(
            r["max_context_kv_per_depth"] for r in ordered)


def test_batch_wfd_advantage_vanishes_as_kv_reads_grow():
    result, _ = studies.run("batch")
    huginn = [r for r in result.rows if r["model"] == "huginn-3.5b"]
    assert huginn[0]["wfd_speedup"] > 4 > 1 > huginn[-1]["wfd_speedup"]
    assert huginn[-1]["wfd_kv_share"] > huginn[0]["wfd_kv_share"]
    # the lead never grows with the batch, and shrinks with every doubling once KV reads are a
    # third of the wave's time
    pairs = list(zip(huginn, huginn[1:], strict=False))
    assert all(b["wfd_speedup"] <= a["wfd_speedup"] * (1 + 1e-9) for a, b in pairs)
    assert all(b["wfd_speedup"] < a["wfd_speedup"] for a, b in pairs if a["wfd_kv_share"] > 0.3)


def test_overhead_study_splits_the_gain():
    result, _ = studies.run("overhead", small=True)
    for row in result.rows:
        assert row["wfd_speedup_no_overhead"] > 1
        assert row["ar_ms_eager"] <= row["ar_ms_python_heavy"]
        # graphs mode saves launches but reads static spans (whole blocks of 256 keys): where
        # the preset's eager host hides behind the device, it costs those keys' bytes more
        spans = mean_decode_keys(1024, 512, True) / mean_decode_keys(1024, 512, False)
        assert row["ar_ms_graphs"] <= row["ar_ms_eager"] * spans
    ouro = next(r for r in result.rows if r["model"] == "ouro-2.6b")
    # a host-bound stack: part of WFD's gain is amortized launches
    assert ouro["wfd_speedup_python_heavy"] != pytest.approx(ouro["wfd_speedup_no_overhead"])


def test_paper_table_derives_overhead_from_ar_only_and_compares():
    result, _ = studies.run("paper-table")
    derived = result.summary["derived_overhead"]
    hw = get_hardware("a6000")
    # the derived setting reproduces the three AR figures of the paper it was derived from:
    # 18% and 74% of the roofline, and Ouro's GPU idle for 65% of a token
    for model, roofline in (("ouro-2.6b", 0.18), ("huginn-3.5b", 0.74)):
        ar = predict(model, derived_hardware(model, hw, derived),
                     Workload(context_length=512, new_tokens=512)).schedules["ar"]
        assert ar.roofline_fraction == pytest.approx(roofline, rel=0.02)
        if model == "ouro-2.6b":
            idle = ar.breakdown.overhead_s / ar.latency_per_token_s
            assert idle == pytest.approx(0.65, rel=0.02)
    assert derived["launch_overhead_s"] == pytest.approx(
        derive_overhead(hw.with_terms(**{"launch_overhead_s": 1.0}))["launch_overhead_s"])
    wfd = [r for r in result.rows if r["schedule"] == "wfd"]
    assert {r["model"] for r in wfd} == {"ouro-2.6b", "huginn-3.5b"}
    assert all(r["reported_speedup"] in (2.42, 3.54) for r in wfd)
    assert any(r["schedule"] == "dtv" and r["block_length"] == 8 for r in result.rows)


def test_overhead_study_sweeps_host_speed_in_both_modes():
    result, _ = studies.run("overhead")
    sweep = result.summary["tables"]["Speedup against host speed (eager and CUDA graphs)"]

    def row(model, mode, speed, hardware="h200"):
        return next(r for r in sweep if r["hardware"] == hardware and r["model"] == model
                    and r["mode"] == mode and r["host_speed"] == speed)

    # on the paper's Python-heavy host an H200 runs Huginn host-bound: a WFD wave dispatches
    # what one block call does, so WFD's lead over DtV is widest there and narrows as a faster
    # host leaves the device the bottleneck
    slow, fast = row("huginn-3.5b", "eager", 1.0), row("huginn-3.5b", "eager", 16.0)
    assert (slow["ar_bound"], fast["ar_bound"]) == ("overhead", "bandwidth")
    assert slow["wfd_over_dtv"] > fast["wfd_over_dtv"] > 1
    assert row("huginn-3.5b", "graphs", 1.0)["wfd_over_dtv"] > 1
    assert row("ouro-2.6b", "eager", 16.0)["ar_ms"] < row("ouro-2.6b", "eager", 1.0)["ar_ms"]
    # graphs mode leaves little host time to speed up
    graphs = [row("ouro-2.6b", "graphs", s)["ar_ms"] for s in (1.0, 16.0)]
    assert graphs[1] == pytest.approx(graphs[0], rel=0.02)


def test_hardware_study_sweeps_host_speed_on_every_device():
    result, _ = studies.run("hardware", small=True)
    sweep = result.summary["tables"]["Speedup against host speed (eager and CUDA graphs)"]
    devices = {r["hardware"] for r in result.rows}
    assert {(r["hardware"], r["mode"]) for r in sweep} == {(d, m) for d in devices
                                                           for m in ("eager", "graphs")}
    # a row in each mode, with a host slower and faster than the device's own, is what the
    # command line's `predict --mode --host-speed` says
    sample = [r for r in sweep if r["host_speed"] in (0.5, 4.0)][::5]
    assert {r["mode"] for r in sample} == {"eager", "graphs"}
    for r in sample:
        out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--model",
                              r["model"], "--hardware", r["hardware"], "--mode", r["mode"],
                              "--host-speed", str(r["host_speed"]), "--json"],
                             capture_output=True, text=True, timeout=60)
        s = json.loads(out.stdout)["schedules"]
        assert r["wfd_speedup"] == pytest.approx(s["wfd"]["speedup_vs_ar"], rel=1e-9)
        assert r["ar_ms"] == pytest.approx(s["ar"]["latency_per_token_s"] * 1e3, rel=1e-9)


def test_paper_table_sensitivity_changes_one_assumption_at_a_time(tmp_path):
    from studies.common import write_outputs
    from studies.paper_table import PRIOR_KERNELS, counted_kernels

    result, _ = studies.run("paper-table")
    table = result.summary["tables"]["Sensitivity: one assumption changed at a time"]
    assert counted_kernels("ouro-2.6b")["kernels_per_layer"] == 48  # operations.json

    def wfd(model, assumption, d):
        return next(r["wfd_speedup"] for r in table if r["model"] == model
                    and r["assumption"].startswith(assumption) and r["draft_depth"] == d)

    # host-bound Ouro follows the kernels a wave adds; device-bound Huginn barely does
    assert wfd("ouro-2.6b", "prior kernels", 1) < wfd("ouro-2.6b", "counted kernels, attention",
                                                      1) < wfd("ouro-2.6b", "counted kernels, "
                                                               "batched", 1)
    assert wfd("huginn-3.5b", "prior kernels", 4) == pytest.approx(
        wfd("huginn-3.5b", "counted kernels, batched", 4), rel=0.05)
    assert wfd("huginn-3.5b", "counted kernels, batched", 2) > wfd(
        "huginn-3.5b", "counted kernels, batched", 8)
    low, high = result.summary["wfd_speedup_range"]["ouro-2.6b"]
    assert low <= 2.42 <= high
    assert len({r["assumption"] for r in table}) == 4
    # each assumption reproduces the AR figures it was derived from
    from studies.paper_table import derive_overhead

    hw = get_hardware("a6000")
    kernels = {m: PRIOR_KERNELS for m in ("ouro-2.6b", "huginn-3.5b")}
    derived = derive_overhead(hw, False, kernels)
    for model, roofline in (("ouro-2.6b", 0.18), ("huginn-3.5b", 0.74)):
        ar = predict(model, derived_hardware(model, hw, derived, False, kernels),
                     Workload(context_length=512, new_tokens=512)).schedules["ar"]
        assert ar.roofline_fraction == pytest.approx(roofline, rel=0.02), model
    # host time added to the device's cannot give Huginn 74% with Ouro's launch gap: said so
    additive = [r for r in table if r["assumption"].endswith("added to the device's")]
    assert all(r["wfd_speedup"] is None and "inconsistent" in r["note"] for r in additive)
    with pytest.raises(ValueError, match="would need 1[0-9][0-9]% of the peak bandwidth"):
        derive_overhead(hw, True)
    markdown = open(write_outputs(result, tmp_path)["markdown"]).read()
    assert "## Sensitivity: one assumption changed at a time" in markdown


def test_cli_json_and_unknown_study(tmp_path):
    out = subprocess.run([sys.executable, "-m", "costmodel", "study", "memory", "--out",
                          str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["name"] == "memory" and payload["rows"]
    bad = subprocess.run([sys.executable, "-m", "costmodel", "study", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown study")
    listed = subprocess.run([sys.executable, "-m", "costmodel", "study", "list", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert "memory" in json.loads(listed.stdout)["studies"]  # it printed names, not JSON
    (tmp_path / "a-file").write_text("")
    blocked = subprocess.run([sys.executable, "-m", "costmodel", "study", "memory", "--out",
                              str(tmp_path / "a-file")], capture_output=True, text=True,
                             timeout=60)
    assert blocked.returncode == 2 and "is a file" in blocked.stderr


PROFILES = PROFILES_DIR


@pytest.mark.parametrize("name", list(studies.STUDIES))
def test_a_cpu_profile_is_studied_in_its_own_dtype_or_refused(name):
    """A CPU calibration prices fp32 (its flops) and runs eagerly: a study prices it so, and one
    about a GPU's launches or the paper's GPU setting says it cannot, in one line."""
    cpu = load_profile(PROFILES / "cpu-huginn-fp32-quick.json").hardware
    module = importlib.import_module(f"studies.{name.replace('-', '_')}")
    if getattr(module, "GPU_ONLY", None):
        with pytest.raises(ValueError, match="is a CPU"):
            studies.run(name, profile=cpu, small=True)
        return
    result, _ = studies.run(name, profile=cpu, small=True)
    tables = [result.rows, *result.summary.get("tables", {}).values()]
    mine = [r for rows in tables for r in rows if r.get("hardware") in (None, cpu.name)]
    assert mine and all(r.get("mode", "eager") == "eager" for r in mine)
    priced = [r for r in mine if r.get("best") != "does not fit"]
    assert priced  # not every configuration "does not fit" for want of bf16 flops


def test_a_gpu_profile_is_studied_in_bf16():
    gpu = load_profile(PROFILES / "gpu-huginn-bf16.json").hardware
    result, _ = studies.run("adaptive-depth", profile=gpu, small=True)
    assert any(r["hardware"] == gpu.name for r in result.rows)


def test_a_table_whose_rows_leave_columns_out_keeps_them_all(tmp_path):
    rows = [{"model": "m", "best": "does not fit"}, {"model": "m", "best": "WFD", "speedup": 2.0}]
    assert to_csv(rows).splitlines()[0] == "model,best,speedup"
    assert to_markdown(rows).splitlines()[0] == "| model | best | speedup |"
    out = subprocess.run([sys.executable, "-m", "costmodel", "study", "paper-table", "--profile",
                          str(PROFILES / "cpu-ouro-fp32-quick.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("error: study")


def test_a_figure_that_cannot_be_written_names_the_file(tmp_path):
    # it named its temporary twin (".f.png.tmp.png")
    pytest.importorskip("matplotlib")
    from costmodel.figures import save_figure

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match=f"cannot write {blocker / 'f.png'}"):
        save_figure(blocker / "f.png", lambda fig: fig.add_subplot(), (2, 2))
    assert save_figure(tmp_path / "f.png", lambda fig: fig.add_subplot(), (2, 2))
    assert (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")


def test_serving_study_finds_where_each_schedule_keeps_its_objectives():
    """The serving study: at the light rate every schedule meets the objectives and WFD gives
    the shortest time per token; more load never shortens the first token's wait."""
    result, _ = studies.run("serving", small=True)
    for (model,), mine in by(result.rows, "model").items():
        light = {r["schedule"]: r for r in mine if r["rate_per_s"] == 0.5}
        assert all(r["slo_attainment"] == 1.0 for r in light.values())
        assert light["wfd"]["tpot_p50_s"] < light["ar"]["tpot_p50_s"]
        for (schedule,), rates in by(mine, "schedule").items():
            ttft = [r["ttft_p50_s"] for r in sorted(rates, key=lambda r: r["rate_per_s"])]
            # (at light load a lone prefill's, the same to rounding)
            assert all(later >= earlier * (1 - 1e-12)
                       for earlier, later in zip(ttft, ttft[1:], strict=False)), (model, schedule)
        kept = result.summary[model]["highest_rate_meeting_objectives_per_s"]
        assert set(kept) == {"ar", "dtv", "wfd", "ar exits", "dtv exits"}
        assert all(k is not None for k in kept.values())
        # a lone request's tokens stop early: AR with exits is faster at the light rate
        assert light["ar exits"]["tpot_p50_s"] < light["ar"]["tpot_p50_s"]
        assert light["ar"]["mean_exit_depth"] is None
        assert 1 < light["ar exits"]["mean_exit_depth"] < get_model(model).default_depth
