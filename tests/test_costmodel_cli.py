"""The `costmodel` command as a user runs it: in a subprocess, reading stdout, stderr and the
exit code."""

import json
import subprocess
import sys

import pytest
from conftest import run_cli

from costmodel.store import PROFILES_DIR

COSTMODEL = [sys.executable, "-m", "costmodel"]
CPU_PROFILE = str(PROFILES_DIR
                  / "cpu-huginn-fp32-quick.json")


def run(*args):
    return subprocess.run([*COSTMODEL, *args], capture_output=True, text=True, timeout=60)


def test_readme_example_prints_a_table_where_wfd_beats_dtv_beats_ar():
    out = run("predict", "--bandwidth", "768GB/s", "--width", "8")
    assert out.returncode == 0, out.stderr
    assert "WFD d=4 W=8" in out.stdout and "AR" in out.stdout
    payload = json.loads(run("predict", "--bandwidth", "768GB/s", "--width", "8",
                             "--json").stdout)
    s = payload["schedules"]
    assert s["wfd"]["speedup_vs_ar"] > s["dtv"]["speedup_vs_ar"] > 1.0
    assert s["ar"]["block_calls_per_token"] == 32


def test_json_has_the_documented_shape():
    payload = json.loads(run("predict", "--model", "ouro-2.6b", "--json").stdout)
    assert payload["model"] == "ouro-2.6b" and payload["hardware"] == "a6000"
    assert set(payload["memory"]) >= {"fits", "weights_bytes", "kv_bytes", "total_bytes",
                                      "capacity_bytes", "max_context", "max_batch"}
    for key in ("ar", "dtv", "wfd"):
        entry = payload["schedules"][key]
        assert set(entry) >= {"latency_per_token_s", "tokens_per_s", "speedup_vs_ar",
                              "block_calls_per_token", "draft_depth", "width", "block_length",
                              "breakdown"}
        assert set(entry["breakdown"]) == {"weights_s", "kv_s", "compute_s", "overhead_s",
                                           "link_s"}  # link_s: 0 on one device


def test_a_run_of_prompts_is_said_and_priced_as_such():
    args = ("predict", "--model", "huginn-3.5b", "--hardware", "h100-sxm", "--context", "64",
            "--new-tokens", "24", "--batch", "4")
    table = run(*args, "--prompts", "6")
    assert table.returncode == 0, table.stderr
    assert "batch 4 (a run of 6 prompts to its end)" in " ".join(table.stdout.split())
    assert "batch 4 (steady state)" in " ".join(run(*args).stdout.split())
    finite = json.loads(run(*args, "--prompts", "6", "--json").stdout)
    steady = json.loads(run(*args, "--json").stdout)
    assert finite["workload"]["prompts"] == 6 and steady["workload"]["prompts"] is None
    # a short run ends with the batch emptying: fewer tokens/s than a batch kept full
    for kind in ("dtv", "wfd"):
        assert (finite["schedules"][kind]["tokens_per_s"]
                < steady["schedules"][kind]["tokens_per_s"])


def test_overrides_change_the_prediction():
    base = json.loads(run("predict", "--json").stdout)["schedules"]["ar"]
    fast = json.loads(run("predict", "--bandwidth", "4.8TB/s", "--json").stdout)
    assert fast["schedules"]["ar"]["latency_per_token_s"] < base["latency_per_token_s"]
    assert fast["hardware_spec"]["memory_bandwidth_bytes_per_s"] == 4.8e12
    slow = ("predict", "--model", "ouro-2.6b", "--launch-overhead", "50us", "--json")
    eager = json.loads(run(*slow).stdout)["schedules"]["ar"]
    graphs_run = json.loads(run(*slow, "--mode", "graphs").stdout)
    graphs = graphs_run["schedules"]["ar"]
    assert graphs["breakdown"]["overhead_s"] < eager["breakdown"]["overhead_s"]
    assert graphs_run["mode"] == "graphs"


def test_host_speed_scales_the_host_terms_only():
    slow = ("predict", "--model", "ouro-2.6b", "--launch-overhead", "50us",
            "--hardware", "a6000", "--json")
    base = json.loads(run(*slow).stdout)
    fast = json.loads(run(*slow, "--host-speed", "4").stdout)
    assert fast["host_speed"] == 4.0 and base["host_speed"] == 1.0
    for term in ("host_overhead_s", "launch_overhead_s", "layer_overhead_s",
                 "graph_launch_overhead_s"):
        assert fast["hardware_spec"][term] == pytest.approx(base["hardware_spec"][term] / 4)
    for key in ("memory_bandwidth_bytes_per_s", "bandwidth_efficiency", "flops_efficiency"):
        assert fast["hardware_spec"][key] == base["hardware_spec"][key]
    a, b = base["schedules"]["ar"]["breakdown"], fast["schedules"]["ar"]["breakdown"]
    assert b["overhead_s"] < a["overhead_s"] and b["weights_s"] == a["weights_s"]
    for bad in (("--host-speed", "0"), ("--host-speed", "-2"), ("--mode", "fast")):
        out = run(*slow, *bad)
        assert out.returncode == 2 and out.stderr.startswith("error:"), bad


def test_context_that_does_not_fit_is_reported_not_priced():
    out = run("predict", "--context", "100000", "--json")
    assert out.returncode == 1
    payload = json.loads(out.stdout)
    assert payload["memory"]["fits"] is False and payload["schedules"] == {}
    assert len(out.stderr.strip().splitlines()) == 1
    assert (f"at most {payload['memory']['max_context']:,} tokens of sequence fit"
            in out.stderr)
    table = run("predict", "--context", "100000")
    assert "DOES NOT FIT" in table.stdout and "ms/token" not in table.stdout


def test_a_batch_that_does_not_fit_says_how_many_sequences_would():
    out = run("predict", "--batch", "64", "--json")
    assert out.returncode == 1
    memory = json.loads(out.stdout)["memory"]
    assert 1 <= memory["max_batch"] < 64
    assert f"or {memory['max_batch']:,} sequences of this length fit" in out.stderr
    # the largest batch fits, one more does not
    fits = run("predict", "--batch", str(memory["max_batch"]), "--json")
    over = run("predict", "--batch", str(memory["max_batch"] + 1), "--json")
    assert fits.returncode == 0 and over.returncode == 1
    assert "the weights alone do not fit" in run("predict", "--memory", "4GB").stderr


def test_kv_sharing_lets_longer_contexts_fit():
    out = run("predict", "--context", "100000", "--kv-sharing", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory"]["fits"] is True
    # priced, and said to be past the model's 4,096 positions, which the decoder refuses
    assert "huginn-3.5b has 4,096 positions" in out.stderr
    assert "positions" not in run("predict", "--context", "3584").stderr


@pytest.mark.parametrize(
    "args",
    [["--bandwidth", "768GB"], ["--bandwidth", "-5GB/s"], ["--memory", "lots"],
     ["--launch-overhead", "5 parsecs"], ["--flops", "1TB/s"], ["--model", "gpt-5"],
     ["--hardware", "tpu"], ["--width", "0"], ["--width", "33"], ["--width", "1"],
     ["--draft-depth", "32"], ["--draft-depth", "0"], ["--acceptance", "1.5"],
     ["--acceptance", "-0.1"], ["--block-length", "0"], ["--batch", "0"], ["--context", "0"],
     ["--kv-sharing", "-1"], ["--dtype", "int3"], ["--width", "8", "--draft-depth", "4"],
     ["--depth", "1"], ["--no-such-flag"], ["--prompts", "0"], ["--batch", "4", "--prompts", "2"],
     ["--prompts", "1000", "--new-tokens", "512"], ["--prompts", "2", "--new-tokens", "1"],
     ["--exit", "kl"], ["--exit", "gate:2", "--exit-depths", "8:1"], ["--exit-depths", "8:0.5"],
     ["--exit-depths", "33:1"], ["--exit-depths", "eight"], ["--min-depth", "3"],
     ["--exit-depths", "8:1", "--prompts", "4"], ["--exit-kv", "reference"],
     ["--exit-depths", "8:1", "--exit-kv", "nearest"],
     ["--tensor-parallel", "4"], ["--tensor-parallel", "0"], ["--link", "pcie4"],
     ["--tensor-parallel", "5", "--link", "copper"],
     ["--tensor-parallel", "5", "--link-bandwidth", "fast"], ["--placement", "p|c"],
     ["--placement", "p|r|c", "--tensor-parallel", "5"],
     ["--profile", CPU_PROFILE, "--model", "huginn-tiny", "--mode", "graphs"],
     ["--profile", CPU_PROFILE, "--model", "huginn-tiny", "--engine", "vllm", "--mode",
      "graphs"]],
)
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    # in this process (a run of the command itself: test_refusals.py)
    code, out, err = run_cli(capsys, "predict", *args)
    assert code == 2, (args, out, err)
    lines = err.splitlines()  # a blank line first is two (a spinner left one)
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err and "Value error" not in err


def test_unknown_preset_error_lists_known_ones():
    out = run("predict", "--model", "gpt-5")
    assert "huginn-3.5b" in out.stderr and "ouro-2.6b" in out.stderr


def test_the_cli_does_not_import_torch_scipy_or_matplotlib():
    code = ("import sys, costmodel.cli; "
            "print(sorted(m for m in ('torch', 'scipy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_acceptance_from_a_measured_depth_trace(tmp_path):
    from costmodel.trace import DepthRecord, TraceHeader, write_jsonl

    header = TraceHeader(trace="depths", source="measured", model="huginn-tiny", device="cpu",
                         dtype="fp32", depth=32, prompt_length=10)
    # depth 4 agrees with depth 32 at 3 of 4 decoded positions
    records = [DepthRecord(position=10 + i, token=5, top1_prob=[0.5] * 32,
                           predictions=[5] * 3 + [5 if i else 7] + [5] * 28) for i in range(4)]
    path = tmp_path / "depths.jsonl"
    write_jsonl(path, header, records)
    out = run("predict", "--depth-trace", str(path), "--width", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["schedules"]["wfd"]["acceptance"] == 0.75
    both = run("predict", "--depth-trace", str(path), "--acceptance", "0.9")
    assert both.returncode == 2 and "not both" in both.stderr
    wrong = run("predict", "--depth-trace", str(path), "--model", "ouro-2.6b")
    assert wrong.returncode == 2 and "R = 32" in wrong.stderr
    missing = run("predict", "--depth-trace", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "cannot read trace" in missing.stderr


def test_a_plain_predict_imports_only_what_it_uses():
    """`costmodel predict`'s start: no table or progress machinery, plotting, fitting, torch,
    decoder, calibration or studies on its path, and only the two presets it names read."""
    code = """
import contextlib, io, sys
sys.argv = ["costmodel", "predict", "--bandwidth", "768GB/s", "--width", "8"]
from costmodel.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main()
    except SystemExit as exc:
        assert exc.code == 0, exc.code
assert "WFD d=4 W=8" in out.getvalue()
from costmodel import presets
loaded = sorted({m.split(".")[0] for m in sys.modules} | {m for m in sys.modules
                                                          if m.startswith("costmodel.")})
print(" ".join(loaded))
print(presets._preset.cache_info().currsize, presets._presets.cache_info().currsize)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    modules, cached = out.stdout.splitlines()
    loaded = set(modules.split())
    assert "costmodel" in loaded and "numpy" in loaded
    assert not loaded & {"rich", "scipy", "matplotlib", "torch", "wfd", "calibrate", "studies",
                         "costmodel.simulate", "costmodel.trace", "costmodel.recommend",
                         "costmodel.profile", "costmodel.exits", "costmodel.adaptive"}
    assert cached == "2 0"  # huginn-3.5b and a6000, not every preset


def test_a_preset_says_where_its_host_terms_come_from():
    eager = json.loads(run("predict", "--model", "ouro-2.6b", "--mode", "eager", "--json").stdout)
    assert "8.93 us per dispatched operation" in eager["host_source"]
    graphs = json.loads(run("predict", "--model", "ouro-2.6b", "--mode", "graphs",
                            "--json").stdout)
    assert (eager["schedules"]["ar"]["latency_per_token_s"]
            > 1.5 * graphs["schedules"]["ar"]["latency_per_token_s"])
    given = run("predict", "--model", "ouro-2.6b", "--launch-overhead", "3us",
                "--host-speed", "2")
    assert "3us per dispatched operation (--launch-overhead) x" in given.stderr
    assert "/ 2 (--host-speed)" in given.stderr
    profile = PROFILES_DIR / "gpu-ouro-bf16.json"
    profiled = json.loads(run("predict", "--profile", str(profile), "--json").stdout)
    assert profiled["host_source"] is None  # the profile's own counts and costs


def test_predict_prices_ar_as_vllm_runs_it():
    """--engine vllm: CUDA graphs (eager on a CPU) and vLLM's kernels
    (costmodel/data/vllm_operations.json);
    on a preset, whose kernels cost the device nothing beyond their bytes, that is this
    decoder's graphs mode; where a kernel has a floor (a profile), vLLM's fewer kernels show."""
    from costmodel.engines import vllm_operations

    def ar(*args):
        out = run("predict", "--model", "ouro-2.6b", "--json", *args)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    vllm = ar("--engine", "vllm")
    assert vllm["mode"] == "graphs" and vllm["engine"] == "vllm"
    counted = vllm_operations("ouro")
    assert vllm["hardware_spec"]["kernels_per_layer"] == sum(counted["layer"].values())
    assert "CUDA graphs" in vllm["host_source"] and "vllm_operations.json" in vllm["host_source"]
    eager = ar("--engine", "vllm", "--mode", "eager")  # vLLM with enforce_eager
    assert eager["mode"] == "eager" and "eager (enforce_eager)" in eager["host_source"]
    graphs = ar("--mode", "graphs")
    assert (vllm["schedules"]["ar"]["latency_per_token_s"]
            == pytest.approx(graphs["schedules"]["ar"]["latency_per_token_s"], rel=1e-3))
    profile = str(PROFILES_DIR / "gpu-ouro-bf16.json")
    floor = ar("--profile", profile, "--mode", "graphs")["schedules"]["ar"]["latency_per_token_s"]
    assert ar("--profile", profile, "--engine", "vllm")["schedules"]["ar"][
        "latency_per_token_s"] < floor
    cpu = run("predict", "--profile", CPU_PROFILE, "--model", "huginn-tiny", "--engine", "vllm",
              "--json")  # vLLM's CPU build: its kernels launched eagerly
    assert cpu.returncode == 0 and json.loads(cpu.stdout)["mode"] == "eager", cpu.stderr
    bad = run("predict", "--engine", "sglang")
    assert bad.returncode == 2 and "unknown engine 'sglang'" in bad.stderr


def test_an_install_without_the_registered_commands_says_to_reinstall(monkeypatch, capsys):
    import importlib.metadata

    from costmodel import cli

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(cli, "_add_registered_commands",
                        cli._add_registered_commands.__wrapped__)
    monkeypatch.setattr(sys, "argv", ["costmodel", "calibrate", "--model", "ouro"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    assert "reinstall (pip install -e .)" in capsys.readouterr().err
