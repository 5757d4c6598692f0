"""Tensor parallelism in the cost model (costmodel.parallel): a model split over T devices as
vLLM splits it, priced as one device's share plus the collectives over the link; refused in
one line where its shapes do not divide."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.cost import call_cost
from costmodel.links import Link
from costmodel.parallel import check_degree, shard, split, working_degrees
from costmodel.predict import predict
from costmodel.presets import get_hardware, get_model
from costmodel.profile import load_profile
from costmodel.store import PROFILES_DIR

FREE = Link(name="free", bandwidth_bytes_per_s=1e30, latency_s=0.0)


def test_huginn_3_5b_splits_only_where_its_55_heads_and_mlp_divide():
    model = get_model("huginn-3.5b")  # 55 heads of 96; MLP 17920 = 2^9 x 5 x 7
    assert working_degrees(model) == [1, 5]
    for degree in (2, 4, 8):
        with pytest.raises(ValueError, match=r"55 heads .* degrees that work: 1, 5$"):
            check_degree(model, degree)
    assert working_degrees(get_model("ouro-2.6b")) == [1, 2, 4, 8, 16]


def test_a_share_holds_1_over_t_of_the_split_matrices_and_all_of_the_rest():
    model = get_model("ouro-2.6b")
    half = shard(model, 2)
    h = model.hidden_size
    # per layer: attention and MLP halved, the four norms whole
    assert half.layer_params == (model.layer_params - 4 * h) // 2 + 4 * h
    assert half.kv_bytes_per_token_per_layer("bf16") * 2 == (
        model.kv_bytes_per_token_per_layer("bf16"))
    assert half.vocab_size * 2 == model.vocab_size
    assert shard(half, 2) is half  # split once
    with pytest.raises(ValueError, match="already split over 2"):
        shard(half, 4)


def test_a_call_s_collectives_are_two_all_reduces_a_layer_and_the_head_s_gather():
    model, hw = split(get_model("ouro-2.6b"), get_hardware("h100-sxm"), 4,
                      Link(name="l", bandwidth_bytes_per_s=100e9, latency_s=5e-6))
    n, width = 8, 2  # positions, bf16
    reduce = 5e-6 + 2 * 3 / 4 * n * model.hidden_size * width / 100e9
    gather = 5e-6 + 3 / 4 * n * 49152 * 4 / 100e9
    block, coda = model.part("block"), model.part("coda")
    for part, expected in ((block, 2 * block.layers * reduce), (coda, gather)):
        cost = call_cost(model, hw, part, "bf16", n_positions=n, n_slots=1,
                         context_sum_positions=n * 100, context_sum_slots=100)
        assert cost.link_s == pytest.approx(expected)
        assert cost.time_s == pytest.approx(cost.weights_s + cost.kv_s + cost.compute_s
                                            + cost.overhead_s + cost.link_s)


@settings(max_examples=20, deadline=None)
@given(degree=st.sampled_from([2, 4, 8]), batch=st.sampled_from([1, 8, 16]))
def test_over_a_free_link_a_bandwidth_bound_decode_streams_1_over_t_of_the_weights(degree,
                                                                                   batch):
    """CUDA graphs, no collectives' cost: each device streams its share of the weights (the
    norms and the hidden states whole), so the weights term of AR falls to about 1/T, and no
    prediction is slower than on one device."""
    hw = get_hardware("h100-sxm").in_mode("graphs")
    one = predict("ouro-2.6b", hw, {"batch_size": batch})
    many = predict("ouro-2.6b", hw, {"batch_size": batch}, tensor_parallel=degree, link=FREE)
    ar_one, ar_many = one.schedules["ar"].breakdown, many.schedules["ar"].breakdown
    assert ar_many.link_s == pytest.approx(0, abs=1e-12)
    # the share's norms and hidden states are whole: a little more than 1/T
    assert ar_one.weights_s / degree <= ar_many.weights_s <= 1.05 * ar_one.weights_s / degree
    for name, result in many.schedules.items():
        assert result.latency_per_token_s <= one.schedules[name].latency_per_token_s * 1.0001


def test_one_device_is_the_prediction_without_parallelism():
    plain = predict("ouro-2.6b", "a6000", {"batch_size": 4})
    once = predict("ouro-2.6b", "a6000", {"batch_size": 4}, tensor_parallel=1)
    assert plain == once


def test_a_cpu_s_ranks_share_its_cores_and_memory():
    hw = load_profile(PROFILES_DIR / "cpu-huginn-fp32-quick.json").hardware
    model, split_hw = split(get_model("ouro-small"), hw, 2)
    assert split_hw.tensor_parallel.link.name == "cpu-shm"
    assert split_hw.roofline.memory_bandwidth_bytes_per_s * 2 == pytest.approx(
        hw.roofline.memory_bandwidth_bytes_per_s)
    assert split_hw.roofline.memory_capacity_bytes * 2 == pytest.approx(
        hw.roofline.memory_capacity_bytes)
    assert split_hw.cpu.matmul_time_scale == pytest.approx(2 * hw.cpu.matmul_time_scale)
    assert split_hw.host == hw.host  # each rank's Python on its own core


def test_predict_and_serving_take_the_devices_and_say_so():
    predict_out = subprocess.run(
        [sys.executable, "-m", "costmodel", "predict", "--model", "ouro-2.6b", "--hardware",
         "h100-sxm", "--tensor-parallel", "2", "--link", "pcie4", "--link-latency", "12us",
         "--json"], capture_output=True, text=True, timeout=60)
    assert predict_out.returncode == 0, predict_out.stderr
    payload = json.loads(predict_out.stdout)
    link = payload["hardware_spec"]["tensor_parallel"]["link"]
    assert payload["hardware_spec"]["tensor_parallel"]["degree"] == 2
    assert link["latency_s"] == pytest.approx(12e-6) and link["bandwidth_bytes_per_s"] == 32e9
    assert payload["schedules"]["ar"]["breakdown"]["link_s"] > 0
    table = subprocess.run(
        [sys.executable, "-m", "costmodel", "serving", "--model", "ouro-2.6b", "--hardware",
         "h100-sxm", "--tensor-parallel", "2", "--requests", "20", "--schedule", "ar"],
        capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "2 x h100-sxm" in table.stdout


# -- P/R/C placement (costmodel.placement) -------------------------------------------------------

def test_placed_parts_add_up_to_one_device_and_the_hand_offs_come_on_top():
    """In order, a placed token costs its parts' times (which sum to predict's latency on one
    device) plus the hand-offs; pipelined across requests, the busiest device's share: Huginn-
    3.5B's block, which runs R times a token."""
    from costmodel.placement import place

    hw = get_hardware("h100-sxm").in_mode("graphs")
    model = get_model("huginn-3.5b")
    for layout, devices in (("p|r|c", 3), ("pc|r", 2)):
        placed = place(model, hw, {"batch_size": 1}, layout=layout, link="nvlink4")
        for r in placed.values():
            assert r.devices == devices
            assert sum(r.part_s.values()) == pytest.approx(r.one_device_latency_s, rel=1e-9)
            assert r.latency_s == pytest.approx(r.one_device_latency_s + r.handoff_s)
            assert r.handoff_s > 0 and r.busiest == "block"
            assert r.pipelined_latency_s == pytest.approx(r.part_s["block"])
        # WFD across its wave: the block never waits for the coda, its drafts enter a tick later
        wfd = placed["wfd"]
        assert wfd.lag_ticks == 1
        assert wfd.pipelined_latency_s < wfd.across_wave_latency_s < wfd.one_device_latency_s
        assert placed["ar"].across_wave_latency_s is None


def test_a_free_link_makes_in_order_placement_exactly_one_device():
    from costmodel.placement import place

    placed = place(get_model("ouro-2.6b"), get_hardware("a6000"), {"batch_size": 4},
                   layout="pc|r", link=FREE)
    for r in placed.values():
        assert r.latency_s == pytest.approx(r.one_device_latency_s, rel=1e-9)


def test_the_placement_study_weighs_replication_tensor_parallelism_and_placement():
    import studies

    result, _ = studies.run("placement")
    best = {(b["model"], b["batch"], b["devices"], b["schedule"]): b
            for b in result.summary["best"]}
    # Huginn-3.5B splits only five ways; there tensor parallelism is fastest, while N copies
    # always serve the most tokens a second
    assert best[("huginn-3.5b", 1, 5, "wfd")]["fastest"] == "tensor parallel 5"
    assert not any(r["arrangement"].startswith("tensor parallel") for r in result.rows
                   if r["model"] == "huginn-3.5b" and r["devices"] != 5)
    assert all(b["most_tokens"] == "replicate" for b in result.summary["best"])
    # two devices: WFD's parts placed beat a copy on one sequence's time, AR's do not
    assert best[("huginn-3.5b", 1, 2, "wfd")]["fastest"] == "1 x pc|r"
    assert best[("huginn-3.5b", 1, 2, "ar")]["fastest"] == "replicate"


def test_predict_prices_a_placement_beside_its_table():
    out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--hardware", "h100-sxm",
                          "--mode", "graphs", "--placement", "p|r|c", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    placed = json.loads(out.stdout)["placement"]
    assert set(placed) == {"ar", "dtv", "wfd"} and placed["wfd"]["devices"] == 3


def test_placed_devices_hold_their_parts_weights_and_kv_and_may_fit_what_one_cannot():
    """pc|r: the two devices' bytes add up to one device's weights and KV (a tied embedding held
    once); p|r|c holds the tied table twice. Huginn-3.5B on the A6000 preset at 15,000 tokens
    does not fit one device (14,396 do) and fits two placed (about 16,500 would): predict says
    so and goes on."""
    from costmodel.memory import kv_cache_bytes
    from costmodel.placement import device_bytes
    from costmodel.workload import Workload

    model = get_model("huginn-3.5b")
    wl = Workload(context_length=1024, new_tokens=512)
    kv = kv_cache_bytes(model, wl, depth=32, readout_depths=2)
    two = device_bytes(model, wl, "pc|r", depth=32, readouts=2, lookahead=0, static=False)
    three = device_bytes(model, wl, "p|r|c", depth=32, readouts=2, lookahead=0, static=False)
    assert set(two) == {"prelude + coda", "block"}
    assert sum(two.values()) == model.weight_bytes("bf16") + kv
    assert sum(three.values()) == sum(two.values()) + model.embedding_params * 2
    out = subprocess.run([sys.executable, "-m", "costmodel", "predict", "--context", "15000",
                          "--placement", "pc|r"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "DOES NOT FIT" in out.stdout and "memory per device" in out.stdout
