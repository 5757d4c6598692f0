"""The streams `costmodel serving` serves: lengths drawn from the shipped traces of real
requests (``costmodel.requests.LengthSample``, made by bench/length_samples.py), and a stream's
parts placed on devices of their own (``costmodel.placement.StreamPlacement``)."""

import json

import numpy as np
import pytest
from conftest import bench_module, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.requests import LengthSample


@pytest.mark.parametrize("name", LengthSample.names())
def test_a_shipped_length_sample_draws_pairs_that_fit_the_context(name):
    """A shipped sample loads; its draws are seeded, their means the sample's, and with a
    context every pair fits it, in the share the sample says fits."""
    sample = LengthSample.load(name)
    assert sample.requests == sum(count for _, _, count in sample.cells)
    prompts, outputs = sample.draw(np.random.default_rng(0), 20_000)
    assert (prompts, outputs) == sample.draw(np.random.default_rng(0), 20_000)
    assert min(outputs) >= 2 and min(prompts) >= 1
    mean_prompt, mean_output = sample.mean_tokens()
    assert np.mean(prompts) == pytest.approx(mean_prompt, rel=0.03)
    assert np.mean(outputs) == pytest.approx(mean_output, rel=0.03)
    within = np.mean(np.add(prompts, outputs) <= 2048)
    assert within == pytest.approx(sample.fitting_share(2048), abs=0.01)
    fitting = sample.draw(np.random.default_rng(1), 5_000, context=2048)
    assert max(np.add(*fitting)) <= 2048
    assert np.mean(fitting[0]) < mean_prompt  # the long ones left out


@given(st.integers(3, 20), st.integers(3, 12), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_a_length_sample_made_from_a_trace_holds_its_requests(prompt_top, output_top, seed):
    """bench/length_samples.py's histogram of a trace: every request counted in the cell its
    lengths fall in, and the pairs drawn from it within the cells that hold requests."""
    quarter_octaves = bench_module("length_samples").quarter_octaves

    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 2 ** prompt_top, 50)
    outputs = rng.integers(2, 2 ** output_top, 50)
    p_edges, o_edges = quarter_octaves(prompts.max()), quarter_octaves(outputs.max())
    counts, _, _ = np.histogram2d(prompts, outputs, bins=[p_edges, o_edges])
    sample = LengthSample(name="t", about="t", source="t", requests=50, prompt_edges=p_edges,
                          output_edges=o_edges,
                          cells=[[i, j, int(n)] for (i, j), n in np.ndenumerate(counts) if n])
    assert sum(c for _, _, c in sample.cells) == 50
    drawn_p, drawn_o = sample.draw(rng, 200)
    cells = {(i, j) for i, j, _ in sample.cells}
    def cell(p, o):
        return np.searchsorted(p_edges, p, "right") - 1, np.searchsorted(o_edges, o, "right") - 1

    # (an output of 1 token is drawn as 2: a request asks for 2 at least)
    assert all(cell(p, o) in cells or o == 2 for p, o in zip(drawn_p, drawn_o, strict=True))


def test_the_command_draws_a_shipped_sample_and_says_what_fits(capsys):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "40",
                             "--lengths", "azure-code-2023", "--fidelity", "steps", "--json")
    assert code == 0, err
    assert json.loads(out)["lengths"] == "azure-code-2023"
    assert "azure-code-2023's requests that fit the model's context of 2048 tokens" in err


STREAM = dict(max_batch=16, dtype="bf16", fidelity="steps")


def _stream():
    from costmodel.requests import Lengths, request_stream

    return request_stream(2.0, 300, Lengths(low=256, high=1024), Lengths(low=64, high=256),
                          seed=0)


def test_placing_the_parts_frees_the_block_under_wfd_and_costs_ar_its_hand_offs():
    """Huginn-3.5B on the H100 preset: AR's block runs R times a token, so placed it runs
    as on one device (one group, in order) plus the hand-offs; WFD reads out every tick, and
    its waves in groups pipelined over two devices take less time a token."""
    from costmodel.presets import resolve
    from costmodel.serving import predict_serving

    model, hw = resolve("huginn-3.5b", "h100-sxm")
    stream = _stream()
    one = predict_serving(model, hw, stream, **STREAM)
    placed = predict_serving(model, hw, stream, placement="pc|r", **STREAM)
    assert placed["ar"].tpot_s.p50 == pytest.approx(one["ar"].tpot_s.p50, rel=0.01)
    assert placed["ar"].tpot_s.p50 >= one["ar"].tpot_s.p50
    assert placed["wfd"].tpot_s.p50 < 0.9 * one["wfd"].tpot_s.p50


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 0.2)), min_size=3, max_size=3),
       st.integers(1, 12), st.sampled_from(["p|r|c", "pc|r"]))
@settings(max_examples=60, deadline=None)
def test_a_placed_step_is_between_the_pipe_full_and_one_group_in_order(costs, batch, layout):
    """Each part's step an affine cost of its batch (a pass over the weights, then a share a
    sequence), a free link: a placed step is never longer than one group's pass in order, nor
    shorter than the busiest device's work for the whole batch."""
    from costmodel.links import Link
    from costmodel.placement import StreamPlacement, devices
    from costmodel.presets import resolve

    model, _ = resolve("huginn-3.5b", "h100-sxm")
    free = Link(name="free", source="test", bandwidth_bytes_per_s=1e30, latency_s=0.0)
    b = np.arange(1, batch + 1, dtype=float)[:, None]
    parts = {part: fixed + each * b for part, (fixed, each) in
             zip(("prelude", "block", "coda"), costs, strict=True)}
    step = StreamPlacement(layout, free).step_s(model, [], 0.0, "bf16", parts, batch)
    in_order = sum(t[batch - 1] for t in parts.values())
    busiest = max(sum(parts[n][batch - 1] for n in names) for names in devices(layout))
    assert busiest[0] - 1e-12 <= step[batch - 1][0] <= in_order[0] + 1e-12


def test_placed_devices_hold_more_sequences_than_one():
    """Each device holds its parts' weights and KV only: the stream may reserve more KV."""
    from costmodel.admission import kv_budget_bytes
    from costmodel.links import resolve_link
    from costmodel.placement import StreamPlacement
    from costmodel.presets import resolve
    from costmodel.schedules import WFD

    model, hw = resolve("huginn-3.5b", "a6000")
    one = kv_budget_bytes(model, hw, "bf16", 32, 16, 33, WFD(draft_depth=4))
    placed = kv_budget_bytes(model, hw, "bf16", 32, 16, 33, WFD(draft_depth=4), 0,
                             StreamPlacement("pc|r", resolve_link(hw, None)))
    assert placed > one


@pytest.mark.parametrize("args, said", [
    (["--placement", "pc|r"], "give fidelity steps (--fidelity steps)"),
    (["--placement", "pc|r", "--fidelity", "steps", "--token-budget", "64"],
     "without a token budget"),
    (["--placement", "p|c", "--fidelity", "steps"], "unknown layout 'p|c'"),
    (["--placement", "pc|r", "--tensor-parallel", "2"], "give --placement or --tensor-parallel"),
])
def test_a_placement_the_stream_cannot_take_is_one_line(capsys, args, said):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "3",
                             *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and said in err, err


def test_the_command_serves_a_placed_stream(capsys):
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-3.5b", "--hardware",
                             "h100-sxm", "--requests", "30", "--placement", "p|r|c",
                             "--fidelity", "steps", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["placement"] == "p|r|c" and set(result["schedules"]) == {"ar", "dtv", "wfd"}


@pytest.mark.parametrize("content, said", [
    ('{"name": "x", "about": "x", "source": "x", "requests": 3, "prompt_edges": [1, 2], '
     '"output_edges": [2, 4], "cells": [[0, 5, 3]]}', "cell (0, 5) lies outside the edges"),
    ('{"name": "x", "about": "x", "source": "x", "requests": 4, "prompt_edges": [1, 2], '
     '"output_edges": [2, 4], "cells": [[0, 0, 3]]}', "the cells count 3 requests, not 4"),
    ('{"name": "x", "about": "x", "source": "x", "requests": 3, "prompt_edges": [2, 1], '
     '"output_edges": [2, 4], "cells": [[0, 0, 3]]}', "prompt edges must be two or more"),
    ("{not json", "Invalid JSON"),
])
def test_a_length_sample_file_that_does_not_hold_is_one_line(capsys, tmp_path, content, said):
    path = tmp_path / "lengths.json"
    path.write_text(content)
    code, out, err = run_cli(capsys, "serving", "--model", "huginn-tiny", "--requests", "3",
                             "--lengths", str(path))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and said in err, err
