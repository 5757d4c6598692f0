import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel import get_hardware, get_model
from costmodel.cost import call_cost

MODELS = ["huginn-3.5b", "ouro-2.6b"]
HW = ["a6000", "h100-sxm", "rtx4090"]


def _block(model, hw, n, slots, ctx, dtype="bf16"):
    m = get_model(model)
    return call_cost(m, get_hardware(hw), m.part("block"), dtype, n_positions=n, n_slots=slots,
                     context_sum_positions=n * ctx, context_sum_slots=slots * ctx)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(HW), st.integers(1, 32), st.integers(1, 31),
       st.integers(1, 32768))
def test_more_distinct_slots_never_make_a_call_cheaper(model, hw, n, slots, ctx):
    fewer = _block(model, hw, n, slots, ctx)
    more = _block(model, hw, n, slots + 1, ctx)
    assert float(more.time_s) >= float(fewer.time_s)
    assert float(more.kv_read_bytes) > float(fewer.kv_read_bytes)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(HW), st.integers(1, 63), st.integers(1, 8192))
def test_weights_are_read_once_per_call(model, hw, n, ctx):
    one = _block(model, hw, n, 1, ctx)
    two = _block(model, hw, n + 1, 1, ctx)
    assert float(one.weight_bytes) == float(two.weight_bytes)
    assert float(two.time_s) >= float(one.time_s)
    # a call over n + 1 positions costs far less than n + 1 single-position calls
    single = _block(model, hw, 1, 1, ctx)
    assert float(two.time_s) < (n + 1) * float(single.time_s) or n == 0


def test_a_bandwidth_bound_call_costs_its_bytes_and_bytes_are_derived():
    m = get_model("huginn-3.5b")
    hw = get_hardware("a6000")
    c = _block("huginn-3.5b", "a6000", 1, 1, 1000)
    # one position: the weights and the KV stream at the achievable bandwidths, the launches
    # hide behind them (a GPU), and nothing is compute
    streamed = (float(c.weight_bytes) + float(c.activation_bytes)) / \
        hw.weight_bandwidth_bytes_per_s + (float(c.kv_read_bytes) + float(c.kv_write_bytes)) \
        / hw.kv_bandwidth_bytes_per_s
    assert float(c.time_s) == pytest.approx(streamed, rel=1e-9)
    assert float(c.compute_s) == 0 and float(c.overhead_s) == 0
    assert float(c.weight_bytes) == m.part("block").weight_params * 2
    assert float(c.kv_read_bytes) == 4 * 2 * 5280 * 2 * 1000


def test_large_batches_turn_compute_bound():
    c = _block("huginn-3.5b", "a6000", 4096, 1, 100)
    assert float(c.compute_s) > 0 and float(c.weights_s) == 0


def test_vectorized_equals_scalar():
    ctx = np.array([10.0, 1000.0, 30000.0])
    vec = _block("ouro-2.6b", "h200", 8, 4, ctx)
    for i, x in enumerate(ctx):
        assert float(vec.time_s[i]) == float(_block("ouro-2.6b", "h200", 8, 4, x).time_s)


def test_cuda_graphs_cut_launch_overhead_only():
    m = get_model("ouro-2.6b")
    hw = get_hardware("a6000").model_copy(update={"overhead_overlaps": False})
    eager = call_cost(m, hw, m.part("block"), "bf16", 1, 1, 100, 100)
    graphs = call_cost(m, hw.model_copy(update={"cuda_graphs": True}), m.part("block"), "bf16",
                       1, 1, 100, 100)
    assert float(graphs.overhead_s) < float(eager.overhead_s)
    assert float(graphs.weights_s) == float(eager.weights_s)


def test_overlapped_overhead_is_hidden_behind_long_calls_only():
    m = get_model("ouro-2.6b")
    hw = get_hardware("a6000")
    assert hw.overhead_overlaps
    big = call_cost(m, hw, m.part("block"), "bf16", 1, 1, 100, 100)
    assert float(big.overhead_s) == 0.0  # 3.9 ms of launches under 8 ms of weight reads
    slow_host = hw.model_copy(update={"launch_overhead_s": 50e-6})
    exposed = call_cost(m, slow_host, m.part("block"), "bf16", 1, 1, 100, 100)
    serial = call_cost(m, slow_host.model_copy(update={"overhead_overlaps": False}),
                       m.part("block"), "bf16", 1, 1, 100, 100)
    assert 0 < float(exposed.overhead_s) < float(serial.overhead_s)
    assert float(exposed.time_s) == max(float(serial.overhead_s),
                                        float(serial.time_s - serial.overhead_s))


def test_rows_below_the_blocked_kernel_stream_the_weights_once_each():
    m = get_model("huginn-mid")
    hw = get_hardware("a6000").model_copy(update={
        "overhead_overlaps": False, "blocked_gemm_rows": 4, "blocked_gemm_weight_passes": 2.0})

    def weights_s(n):
        return float(call_cost(m, hw, m.part("block"), "fp32", n, 1, n, 1).weights_s)

    one = weights_s(1)
    assert weights_s(3) > 2.9 * one  # three vector products: three passes (plus activations)
    assert weights_s(4) < 2.1 * one and weights_s(8) < 2.1 * one  # blocked: two passes
    on_gpu = get_hardware("a6000").model_copy(update={"overhead_overlaps": False})
    assert float(call_cost(m, on_gpu, m.part("block"), "fp32", 3, 1, 3, 1).weights_s) < 1.01 * (
        float(call_cost(m, on_gpu, m.part("block"), "fp32", 1, 1, 1, 1).weights_s))
    # with an exponent below 1 each extra row costs less than the one before: 1 + (n - 1) ** 0.5
    concave = hw.model_copy(update={"gemv_row_exponent": 0.5})
    passes_3 = float(call_cost(m, concave, m.part("block"), "fp32", 3, 1, 3, 1).weights_s) / one
    assert 1 + 2**0.5 - 0.01 < passes_3 < 1 + 2**0.5 + 0.05


def test_attention_has_its_own_flops_efficiency():
    m, hw = get_model("huginn-mid"), get_hardware("a6000")
    part = m.part("block")

    def compute_s(hardware, context):  # 64 positions: compute-bound
        return float(call_cost(m, hardware, part, "bf16", 64, 1, 64 * context, context).compute_s)

    same = hw.model_copy(update={"attention_flops_efficiency": hw.flops_efficiency})
    assert compute_s(same, 4096) == pytest.approx(compute_s(hw, 4096))  # None: flops_efficiency
    slow = hw.model_copy(update={"attention_flops_efficiency": hw.flops_efficiency / 4})
    attention = compute_s(hw, 4096) - compute_s(hw, 1)
    assert compute_s(slow, 4096) - compute_s(slow, 1) == pytest.approx(4 * attention, rel=1e-6)


def test_a_model_that_fits_in_the_cache_streams_its_weights_from_it():
    hw = get_hardware("a6000").model_copy(update={
        "overhead_overlaps": False, "cache_bytes": 16e6, "cache_bandwidth_bytes_per_s": 8 * 768e9})
    tiny, mid = get_model("huginn-tiny"), get_model("huginn-mid")
    plain = hw.model_copy(update={"cache_bytes": 0.0})
    for model, speedup in ((tiny, 8.0), (mid, 1.0)):
        cached = call_cost(model, hw, model.part("block"), "fp32", 1, 1, 1, 1)
        memory = call_cost(model, plain, model.part("block"), "fp32", 1, 1, 1, 1)
        assert float(memory.weights_s) / float(cached.weights_s) == pytest.approx(speedup)


def test_vector_products_read_cached_weights_once_per_row():
    # nothing nearer than the cache holds them between rows: n rows, n passes, whatever the
    # fitted passes of weights streamed from memory
    hw = get_hardware("a6000").model_copy(update={
        "overhead_overlaps": False, "cache_bytes": 16e6, "cache_bandwidth_bytes_per_s": 6e12,
        "blocked_gemm_rows": 4, "gemv_row_passes": 0.3, "gemv_row_exponent": 0.5})
    tiny = get_model("huginn-tiny")

    def weights_s(n):
        return float(call_cost(tiny, hw, tiny.part("block"), "fp32", n, 1, n, 1).weights_s)

    assert weights_s(3) == pytest.approx(3 * weights_s(1))  # weights and activations, per row
    mid = get_model("huginn-mid")  # streamed from memory: the fitted passes
    one, three = (float(call_cost(mid, hw, mid.part("block"), "fp32", n, 1, n, 1).weights_s)
                  for n in (1, 3))
    assert three < 1.5 * one


def test_products_below_the_threaded_rows_run_on_one_thread():
    m = get_model("ouro-mid")
    hw = get_hardware("a6000").model_copy(update={
        "overhead_overlaps": False, "memory_bandwidth_bytes_per_s": 1e15, "blocked_gemm_rows": 4,
        "threaded_gemm_rows": 5, "unthreaded_flops_fraction": 0.5,
        "attention_flops_efficiency": 1.0})

    def compute_per_row_s(hardware, n):  # compute-bound: the memory is nearly free
        c = call_cost(m, hardware, m.part("block"), "bf16", n, 1, n, 1)
        assert float(c.compute_s) > 0
        return float(c.compute_s) / n

    threaded = compute_per_row_s(hw, 5)
    assert compute_per_row_s(hw, 4) == pytest.approx(2 * threaded, rel=0.01)
    assert compute_per_row_s(hw, 16) == pytest.approx(threaded, rel=0.01)
    every = hw.model_copy(update={"threaded_gemm_rows": None})  # None: all products threaded
    assert compute_per_row_s(every, 4) == pytest.approx(threaded, rel=0.01)


def test_blocked_products_add_a_fixed_latency_each():
    hw = get_hardware("a6000").model_copy(update={
        "overhead_overlaps": False, "blocked_gemm_rows": 4})
    slow = hw.model_copy(update={"blocked_gemm_latency_s": 20e-6})
    for name, per_layer, extra in (("huginn-mid", 4, 1), ("ouro-mid", 7, 0)):
        m = get_model(name)
        part = m.part("block")
        assert part.matrix_products == part.layers * per_layer + extra
        for n, products in ((3, 0), (4, part.matrix_products), (32, part.matrix_products)):
            base, more = (float(call_cost(m, h, part, "fp32", n, 1, n, 1).overhead_s)
                          for h in (hw, slow))
            assert more - base == pytest.approx(products * 20e-6)
    ouro = get_model("ouro-mid")
    assert ouro.part("coda").matrix_products == 1 + ouro.exit_gate  # the head and the exit gate


def test_each_layer_adds_its_host_overhead():
    hw = get_hardware("a6000").model_copy(update={"overhead_overlaps": False})
    per_layer = hw.model_copy(update={"layer_overhead_s": 40e-6})
    m = get_model("huginn-mid")
    for part in m.parts.values():  # the prelude, block and coda have 2, 4 and 2 layers
        base, more = (float(call_cost(m, h, part, "fp32", 1, 1, 1, 1).overhead_s)
                      for h in (hw, per_layer))
        assert more - base == pytest.approx(part.layers * 40e-6)
    ouro = get_model("ouro-mid")  # its prelude is the embedding alone: no layers
    assert float(call_cost(ouro, per_layer, ouro.part("prelude"), "fp32", 1, 1, 1, 1).overhead_s) \
        == pytest.approx(float(call_cost(ouro, hw, ouro.part("prelude"), "fp32", 1, 1, 1,
                                         1).overhead_s))
