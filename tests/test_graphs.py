"""Captured execution as graphs mode runs it, rehearsed on the CPU in static mode (the same
buffers, workspaces and replay path, without capture): shapes prepared once per process, a
replay that copies in its inputs and nothing else, and static calls that read exactly the keys
the cost model prices."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_CONFIGS, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel import get_hardware
from costmodel.cost import call_cost
from costmodel.predict import predict
from costmodel.slots import STATIC_SPAN_KEYS
from costmodel.workload import Workload
from wfd.checkpoint import build, init_random
from wfd.generate import generate
from wfd.graphs import CallGraphs, workspaces

PROMPT = [5, 9, 33, 2, 17, 40, 8]
SCHEDULES = {"ar": {}, "dtv": {"block_length": 3, "draft_depth": 1}, "wfd": {"draft_depth": 2}}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_second_run_in_a_process_captures_nothing_new(family, schedule):
    model = tiny_model(family)
    options = dict(schedule=schedule, mode="static", force_acceptance=0.7, **SCHEDULES[schedule])
    first = generate(model, PROMPT, max_new_tokens=12, **options)
    assert first.stats["captures_made"] == first.stats["shapes_captured"] > 0
    assert first.stats["captures_reused"] == 0 and first.stats["capture_s"] > 0
    # another prompt of another length, more tokens, the same cache layout and span block
    second = generate(model, PROMPT[:5], max_new_tokens=30, **options)
    assert second.stats["captures_made"] == 0 and second.stats["capture_s"] == 0
    assert second.stats["captures_reused"] == second.stats["shapes_captured"]
    decode = [r for r in second.records if max(r.positions) >= 5]  # the prefill runs eagerly
    assert second.stats["replays"] == len(decode)
    again = generate(model, PROMPT, max_new_tokens=12, **options)
    assert again.tokens == first.tokens and again.stats["captures_made"] == 0
    assert again.stats["shapes_captured"] == first.stats["shapes_captured"]
    assert len(workspaces(model)) == 1


def test_a_run_past_the_workspaces_cache_replaces_it_and_captures_again():
    config = TINY_CONFIGS["ouro"].model_copy(update={"max_position_embeddings": 1024})
    model = init_random(build(config))
    short = generate(model, PROMPT, max_new_tokens=8, mode="static")
    assert short.cache.max_len == STATIC_SPAN_KEYS
    longer = generate(model, PROMPT, max_new_tokens=STATIC_SPAN_KEYS - len(PROMPT) + 1,
                      mode="static")
    assert longer.cache.max_len == 2 * STATIC_SPAN_KEYS
    assert longer.stats["captures_made"] == longer.stats["shapes_captured"]
    eager = generate(model, PROMPT, max_new_tokens=STATIC_SPAN_KEYS - len(PROMPT) + 1)
    assert longer.tokens == eager.tokens  # across the span's block boundary too
    # the cost model's graphs mode allocates the same static cache
    workload = Workload(context_length=len(PROMPT), new_tokens=len(longer.tokens), dtype="fp32")
    predicted = predict(model.config, get_hardware("a6000").in_mode("graphs"), workload)
    assert longer.stats["kv_bytes_allocated"] == predicted.schedules["ar"].kv_bytes
    assert len(workspaces(model)) == 1  # the short one's cache is gone


class Ops(TorchDispatchMode):
    """Every operation dispatched, by name, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.__name__, args))
        return func(*args, **(kwargs or {}))


def test_a_replay_copies_in_its_inputs_and_nothing_else():
    graphs = CallGraphs(capture=False, device=torch.device("cpu"))
    state = torch.randn(2, 8)
    inside, ops = [], Ops()

    def call(ints, slots, x):  # what the call computes is not the replay's host work
        inside.append(len(ops.calls))
        out = x * ints[:2, None] + slots[:, None]
        inside.append(len(ops.calls))
        return out

    def measure(replay):
        return replay(), 0.0

    with torch.inference_mode():
        constants = lambda: [torch.tensor([3, 1])]  # noqa: E731
        graphs.run(("block", (3, 1), 256), call, [7, 8, 11], [state], measure, constants)
        entry = graphs.entries[("block", (3, 1), 256)]
        inside.clear()
        new_state = state + 1
        with ops:
            out, _ = graphs.run(("block", (3, 1), 256), call, [9, 10, 12], [new_state],
                                measure, constants)
    host = ops.calls[:inside[0]] + ops.calls[inside[1]:]
    # the ints staged in place and copied in one transfer, the state copied into its buffer,
    # the output copied out: no tensor built from Python values, no slot copied again
    assert [name for name, _ in host] == ["copy_.default", "copy_.default", "clone.default"]
    assert host[0][1][1] is entry.staging and host[1][1][1] is not entry.staging
    assert entry.ints.tolist() == [9, 10, 12]
    torch.testing.assert_close(out, new_state * torch.tensor([9.0, 10.0])[:, None]
                               + torch.tensor([3.0, 1.0])[:, None])
    assert graphs.usage.replays == 2 and graphs.usage.made == {("block", (3, 1), 256)}


def attention_bytes_per_call(monkeypatch, model, **options):
    """A run, and the K and V bytes its attention kernels received in each of its calls."""
    from wfd.runtime import Runner

    read, per_call = [], []
    attention, log = F.scaled_dot_product_attention, Runner._log

    def counted(q, k, v, *args, **kwargs):
        read.append((k.numel() + v.numel()) * k.element_size())
        return attention(q, k, v, *args, **kwargs)

    def logged(self, *args, **kwargs):
        per_call.append(sum(read))
        read.clear()
        return log(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", counted)
        patch.setattr(Runner, "_log", logged)
        run = generate(model, PROMPT, **options)
    return run, per_call


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_static_call_reads_the_keys_it_is_priced_for(family, schedule, monkeypatch):
    """Each call's attention kernels read the K and V bytes the cost model prices for its
    record, in static mode (graphs mode's calls) and in eager mode, for every schedule."""
    model = tiny_model(family)
    spec = model.config.to_spec("tiny")
    hw = get_hardware("a6000")
    for mode in ("static", "eager"):
        run, per_call = attention_bytes_per_call(
            monkeypatch, model, schedule=schedule, max_new_tokens=24, mode=mode,
            force_acceptance=0.7, **SCHEDULES[schedule])
        static = mode == "static"
        for record, measured in zip(run.records, per_call, strict=True):
            slots = record.slot_contexts()
            cost = call_cost(spec, hw.in_mode("graphs" if static else "eager"),
                             spec.part(record.kind), "fp32",
                             n_positions=len(record.positions), n_slots=len(slots),
                             context_sum_positions=sum(record.contexts),
                             context_sum_slots=sum(slots.values()))
            if static:  # what it reads is exactly what it is priced for
                assert measured == cost.kv_read_bytes, record
            else:  # eager: a wave's slots read up to its latest position, priced up to their own
                assert cost.kv_read_bytes <= measured <= cost.kv_read_bytes * 1.5, record
        assert any(r.kind == "block" for r in run.records)


def test_the_gpu_smoke_script_runs_on_a_cpu_in_eager_and_static_modes(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "calibrate" / "gpu_smoke.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--json",
                          str(tmp_path / "smoke.json")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert report["versions"]["torch"] == torch.__version__
    assert {row["model"] for row in report["backends"]} == {"huginn-3.5b", "ouro-2.6b"}
    assert all(row["decoder"] not in ("unknown", "none") for row in report["backends"])
    timed = [row for row in report["growing_keys"] if row["error"] is None]
    assert timed and all(row["median_ms"] > 0 for row in timed)
    rows = report["tiny_models"]
    assert {(row["model"], row["mode"]) for row in rows} == {
        (m, mode) for m in ("huginn-tiny", "ouro-tiny") for mode in ("eager", "static")}
    for row in rows:  # fp32 on a CPU: the cached decode is the full forward's
        assert row["tokens_equal_first_mode"]
        assert row["argmax_agreement_with_full_forward"] == 1.0
        assert row["max_top1_prob_difference"] < 1e-4
    assert "attention kernel chosen" in out.stdout


def test_a_reused_workspace_still_refuses_a_sequence_past_the_models_context():
    from wfd.generate import GenerationError

    model = tiny_model("ouro")  # 256 positions; a WFD run's cache rounds up to 512
    generate(model, PROMPT, schedule="wfd", max_new_tokens=256 - len(PROMPT), mode="static",
             force_acceptance=0.5)
    with pytest.raises(GenerationError, match="exceeds the model's context of 256"):
        generate(model, PROMPT, schedule="wfd", max_new_tokens=256, mode="static",
                 force_acceptance=0.5)


def test_the_attention_kernel_reported_is_the_decode_calls_not_the_prefills(monkeypatch):
    import wfd.runtime

    asked = {}

    def chosen(model, kind, slots, span):
        asked[kind] = span
        return "flash"

    monkeypatch.setattr(wfd.runtime, "chosen_backend", chosen)
    run = generate(tiny_model("huginn"), PROMPT, max_new_tokens=4, mode="static")
    assert run.stats["attention_backend"] == dict.fromkeys(("prelude", "block", "coda"), "flash")
    assert asked == dict.fromkeys(("prelude", "block", "coda"), STATIC_SPAN_KEYS)
    generate(tiny_model("huginn"), PROMPT, max_new_tokens=1, mode="static")  # a prefill only
    assert asked["block"] == len(PROMPT)
