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
    # equal when the host hides both (the sum of a different split, to the last bit)
    assert float(more.time_s) >= float(fewer.time_s) * (1 - 1e-12)
    assert float(more.kv_read_bytes) > float(fewer.kv_read_bytes)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(HW), st.integers(1, 63), st.integers(1, 8192))
def test_weights_are_read_once_per_call(model, hw, n, ctx):
    one = _block(model, hw, n, 1, ctx)
    two = _block(model, hw, n + 1, 1, ctx)
    assert float(one.weight_bytes) == float(two.weight_bytes)
    assert float(two.time_s) >= float(one.time_s) * (1 - 1e-12)  # equal when host-bound
    # a call over n + 1 positions costs far less than n + 1 single-position calls
    single = _block(model, hw, 1, 1, ctx)
    assert float(two.time_s) < (n + 1) * float(single.time_s)


def test_a_bandwidth_bound_call_costs_its_bytes_and_bytes_are_derived():
    m = get_model("huginn-3.5b")
    hw = get_hardware("a6000")
    c = _block("huginn-3.5b", "a6000", 1, 1, 1000)
    # one position: the weights and the KV stream at the achievable bandwidths, the launches
    # hide behind them (a GPU), and nothing is compute
    r = hw.roofline
    streamed = ((float(c.weight_bytes) + float(c.activation_bytes)) / r.bandwidth_efficiency
                + (float(c.kv_read_bytes) + float(c.kv_write_bytes))
                / (r.kv_bandwidth_efficiency or r.bandwidth_efficiency)
                ) / r.memory_bandwidth_bytes_per_s
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
    hw = get_hardware("a6000").with_terms(**{"overhead_overlaps": False})
    eager = call_cost(m, hw, m.part("block"), "bf16", 1, 1, 100, 100)
    graphs = call_cost(m, hw.with_terms(**{"cuda_graphs": True}), m.part("block"), "bf16",
                       1, 1, 100, 100)
    assert float(graphs.overhead_s) < float(eager.overhead_s)
    assert float(graphs.weights_s) == float(eager.weights_s)


def test_overlapped_overhead_is_hidden_behind_long_calls_only():
    m = get_model("ouro-2.6b")
    hw = get_hardware("a6000")
    assert hw.host.overhead_overlaps
    fast_host = hw.with_terms(**{"launch_overhead_s": 3e-6})
    big = call_cost(m, fast_host, m.part("block"), "bf16", 1, 1, 100, 100)
    assert float(big.overhead_s) == 0.0  # 3.5 ms of launches under 6.5 ms of weight reads
    slow_host = hw.with_terms(**{"launch_overhead_s": 50e-6})
    exposed = call_cost(m, slow_host, m.part("block"), "bf16", 1, 1, 100, 100)
    serial = call_cost(m, slow_host.with_terms(**{"overhead_overlaps": False}),
                       m.part("block"), "bf16", 1, 1, 100, 100)
    assert 0 < float(exposed.overhead_s) < float(serial.overhead_s)
    assert float(exposed.time_s) == max(float(serial.overhead_s),
                                        float(serial.time_s - serial.overhead_s))


def test_a_gpu_streams_the_weights_once_whatever_the_rows():
    m = get_model("huginn-mid")
    on_gpu = get_hardware("a6000").with_terms(**{"overhead_overlaps": False})
    assert float(call_cost(m, on_gpu, m.part("block"), "fp32", 3, 1, 3, 1).weights_s) < 1.01 * (
        float(call_cost(m, on_gpu, m.part("block"), "fp32", 1, 1, 1, 1).weights_s))


def _cpu(**update):
    from conftest import cpu_like_product_s, synthetic_curve

    return get_hardware("a6000").with_terms(**{  # counted as a CPU calibration counts
        "overhead_overlaps": False, "peak_flops_per_s": {"fp32": 100e9}, "kernels_per_layer": 14,
        "matmul": synthetic_curve(cpu_like_product_s), **update})


def test_the_curve_reads_its_measured_points_and_interpolates_between_them():
    from conftest import cpu_like_product_s

    from costmodel.matmul import product_time_s

    curve = _cpu().cpu.matmul
    streamed = curve.working_sets_bytes[-1]
    for size in (2**16, 2**22):
        for n in (1, 3, 8, 32):
            assert product_time_s(curve, size, n, streamed) == pytest.approx(
                cpu_like_product_s(size, n, streamed))
    # rows: linear between measured ones, and each row past the last costs the last step's
    size = 2**22
    t8, t16 = (product_time_s(curve, size, n, None) for n in (8, 16))
    assert product_time_s(curve, size, 12, None) == pytest.approx((t8 + t16) / 2)
    t32 = product_time_s(curve, size, 32, None)
    assert product_time_s(curve, size, 64, None) == pytest.approx(t32 + 32 * (t32 - t16) / 16)
    rows = np.array([1, 2, 12, 64])
    assert product_time_s(curve, size, rows, None) == pytest.approx(
        [product_time_s(curve, size, int(n), None) for n in rows])
    # sizes: log-log between measured ones, at least proportional past the largest, no faster
    # than the smallest below it
    between = product_time_s(curve, 2**21, 1, None)
    assert product_time_s(curve, 2**20, 1, None) < between < product_time_s(curve, 2**22, 1, None)
    assert product_time_s(curve, 2**28, 1, None) >= 4 * product_time_s(curve, 2**26, 1, None)
    assert product_time_s(curve, 2**10, 1, None) == pytest.approx(
        product_time_s(curve, 2**14, 1, None), rel=0.05)


def test_remembered_product_times_equal_fresh_ones_and_cannot_be_altered():
    from costmodel.matmul import _part_matmul_s, part_matmul_s

    curve = _cpu().cpu.matmul
    matrices = [((256, 192), 3), ((512, 192), 2)]
    rows = np.array([1.0, 5.0, 12.0])
    for n_rows, working_set in ((rows, None), (rows, 3e6), (7, 3e6)):
        fresh = _part_matmul_s(curve, matrices, 4, n_rows, working_set)
        first = part_matmul_s(curve, matrices, 4, n_rows, working_set)
        if isinstance(first, np.ndarray):
            first *= 0  # a caller scaling its copy in place must not reach the memo
        assert part_matmul_s(curve, matrices, 4, n_rows, working_set) == pytest.approx(fresh)
    assert part_matmul_s(curve, matrices, 4, rows[:2], None) == pytest.approx(
        _part_matmul_s(curve, matrices, 4, rows[:2], None))  # another vector, another entry
    # whole row counts up to the table's end are read from one table, others priced apart:
    # every reading equals the product times priced on their own, to the last bit
    from costmodel.matmul import ROW_TABLE

    for n_rows in (1, 7, ROW_TABLE, ROW_TABLE + 1, 2.5, np.array([3.0, ROW_TABLE, 40.0])):
        for working_set in (None, 3e6):
            fresh = _part_matmul_s(curve, matrices, 4, n_rows, working_set)
            assert np.array_equal(part_matmul_s(curve, matrices, 4, n_rows, working_set), fresh)
    assert part_matmul_s(curve, [], 4, 3, None) == 0.0  # a part without products


def test_a_row_count_the_curve_did_not_measure_costs_its_next_whole_block():
    from costmodel.matmul import product_time_s

    linear = _cpu().cpu.matmul
    curve = linear.model_copy(update={"row_block": 8})
    size = 2**22
    assert 12 not in curve.rows and 5 not in curve.rows

    def t(c, n):
        return product_time_s(c, size, n, None)

    # measured row counts as they were timed, whatever the block
    for n in curve.rows:
        assert t(curve, n) == t(linear, n)
    # between: the next multiple of 8 (5 rows as 8, 12 as 16); past the last, 41 as 48
    assert t(curve, 5) == t(linear, 8) and t(curve, 12) == t(linear, 16)
    assert t(curve, 41) == pytest.approx(t(linear, 48)) and t(curve, 48) == t(linear, 48)
    assert t(curve, 49) > t(curve, 48)
    assert t(curve, np.array([5, 41])) == pytest.approx([t(curve, 5), t(curve, 41)])


def test_the_row_block_is_read_from_a_staircase_of_times():
    from calibrate.curve import ROW_BLOCK_COUNTS, staircase_block

    counts = ROW_BLOCK_COUNTS
    rng = np.random.default_rng(0)
    for block in (16, 8, 4):
        stairs = [1.1 ** -(-n // block) for n in counts]
        assert staircase_block(counts, stairs) == block
        noisy = [t * (1 + 0.01 * rng.standard_normal()) for t in stairs]
        assert staircase_block(counts, noisy) == block
    # time that grows with every row, or noise without steps: no block
    assert staircase_block(counts, [1.0 + 0.03 * n for n in counts]) == 1
    assert staircase_block(counts, list(1 + 0.05 * rng.standard_normal(len(counts)))) == 1


def test_a_wide_or_tall_matrix_takes_its_aspects_time_over_the_square_ones():
    from costmodel.matmul import product_time_s

    square = _cpu().cpu.matmul
    streamed = square.seconds[-1]
    curve = square.model_copy(update={
        "aspects": [0.25, 4.0], "aspect_seconds": [
            [[0.8 * t for t in line] for line in streamed],
            [[1.5 * t for t in line] for line in streamed]]})
    size = 2**22
    for n in (1, 8):
        base = product_time_s(curve, size, n, None)
        assert base == product_time_s(square, size, n, None, aspect=4.0)  # no tables: square
        assert product_time_s(curve, size, n, None, aspect=4.0) == pytest.approx(1.5 * base)
        assert product_time_s(curve, size, n, None, aspect=2.0) == pytest.approx(
            1.5**0.5 * base)  # halfway in log aspect
        assert product_time_s(curve, size, n, None, aspect=16.0) == pytest.approx(1.5 * base)
        assert product_time_s(curve, size, n, None, aspect=0.25) == pytest.approx(0.8 * base)
        # a cached working set takes the same factor
        assert product_time_s(curve, size, n, 2**23, aspect=4.0) == pytest.approx(
            1.5 * product_time_s(curve, size, n, 2**23))


def test_a_call_in_a_cached_working_set_runs_its_products_from_the_cache():
    from conftest import cpu_like_product_s

    from costmodel.matmul import product_time_s

    curve = _cpu().cpu.matmul
    size = 2**20
    cached, streamed = (product_time_s(curve, size, 1, ws) for ws in (2**23, None))
    assert cached == pytest.approx(cpu_like_product_s(size, 1, 2**23))  # both sets cached
    assert streamed == pytest.approx(cpu_like_product_s(size, 1, 2**27))
    # between the measured sets: in between, and never faster in a larger one
    sets = [2**20, 2**23, 2**24, 2**25, 2**26, 2**27, 2**29]
    times = [product_time_s(curve, size, 1, ws) for ws in sets]
    assert times == sorted(times)
    tiny, mid = get_model("huginn-tiny"), get_model("huginn-mid")  # 4 MB and 100 MB blocks
    hw = _cpu()
    per_byte = [float(call_cost(m, hw, m.part("block"), "fp32", 1, 1, 1, 1).weights_s)
                / (m.part("block").weight_params * 4) for m in (tiny, mid)]
    assert per_byte[1] > 2 * per_byte[0]  # the tiny one's small products: their dispatch too


def test_products_stream_from_the_first_working_set_that_copies_at_memory_speed():
    from costmodel.matmul import product_time_s, streams

    curve = _cpu().cpu.matmul  # cached sets of 1 and 16 MiB, streamed at 128 MiB
    size = 2**20
    knee_at = curve.model_copy(update={"streamed_from_bytes": 2.0**25})  # 32 MiB
    # past the start: the streamed time, where the curve alone interpolates towards it
    assert product_time_s(knee_at, size, 1, 2**26) == pytest.approx(
        product_time_s(curve, size, 1, None))
    assert product_time_s(curve, size, 1, 2**26) < product_time_s(curve, size, 1, None)
    # before it: between the cached and the streamed, never faster in a larger set
    times = [product_time_s(knee_at, size, 1, ws) for ws in (2**24, 2**24.5, 2**25)]
    assert times == sorted(times) and times[0] < times[-1]
    # a start below a cached set drops that set's table: it measured memory, not a cache
    early = curve.model_copy(update={"streamed_from_bytes": 2.0**22})
    assert product_time_s(early, size, 1, 2**24) == pytest.approx(
        product_time_s(curve, size, 1, None))
    assert not streams(curve, 2**26) and streams(knee_at, 2**26) and streams(curve, 2**27)


def test_a_refit_gives_an_older_cpu_profile_the_start_of_streaming_from_its_knee():
    from calibrate.refit import with_streamed_start
    from costmodel.profile import FittedValue

    hw = _cpu()
    knee = {"cache_knee": FittedValue(value=2.0**24, stderr=0.0, unit="B (measured)")}
    assert with_streamed_start(hw, knee).cpu.matmul.streamed_from_bytes == 2.0**25
    assert with_streamed_start(hw, {}).cpu.matmul.streamed_from_bytes is None  # no knee: as it was
    kept = hw.with_terms(**{"matmul": hw.cpu.matmul.model_copy(
        update={"streamed_from_bytes": 2.0**26})})
    assert with_streamed_start(kept, knee).cpu.matmul.streamed_from_bytes == 2.0**26


def test_a_cpu_call_prices_its_products_by_the_curve():
    m = get_model("ouro-mid")
    part = m.part("block")
    hw = _cpu(host_overhead_s=0.0, launch_overhead_s=0.0)
    for n in (1, 3, 4, 32):  # few rows: a pass per row; blocked from 4 rows; then compute
        c = call_cost(m, hw, part, "fp32", n, 1, n, 1)
        twice = call_cost(m, hw.with_terms(**{"matmul_time_scale": 2.0}), part, "fp32", n,
                          1, n, 1)
        products = float(twice.time_s - c.time_s)  # the scale doubles the products alone
        assert products > 0.9 * float(c.time_s)  # the rest: activations, KV, attention
        if n > 1:
            assert float(c.compute_s) > 0  # what rows add beyond one row's weights
    one, three, four = (float(call_cost(m, hw, part, "fp32", n, 1, n, 1).time_s)
                        for n in (1, 3, 4))
    assert three > 2.5 * one and four < 0.8 * three
    # the products' dispatch is in the curve: the per-kernel overhead counts the other kernels
    launches = hw.with_terms(**{"launch_overhead_s": 1e-6})
    extra = float(call_cost(m, launches, part, "fp32", 1, 1, 1, 1).overhead_s)
    kernels = float(call_cost(m, launches, part, "fp32", 1, 1, 1, 1).kernels)
    assert extra == pytest.approx((kernels - part.matrix_products) * 1e-6)
    assert part.matrix_products == part.layers * 7 and m.part("coda").matrix_products == 2


def test_attention_has_its_own_flops_efficiency():
    m, hw = get_model("huginn-mid"), get_hardware("a6000")
    part = m.part("block")

    def compute_s(hardware, context):  # 64 positions: compute-bound
        return float(call_cost(m, hardware, part, "bf16", 64, 1, 64 * context, context).compute_s)

    same = hw.with_terms(**{"attention_flops_efficiency": hw.roofline.flops_efficiency})
    assert compute_s(same, 4096) == pytest.approx(compute_s(hw, 4096))  # None: flops_efficiency
    slow = hw.with_terms(**{"attention_flops_efficiency": hw.roofline.flops_efficiency / 4})
    attention = compute_s(hw, 4096) - compute_s(hw, 1)
    assert compute_s(slow, 4096) - compute_s(slow, 1) == pytest.approx(4 * attention, rel=1e-6)


def test_each_layer_adds_its_host_overhead():
    hw = get_hardware("a6000").with_terms(**{"overhead_overlaps": False})
    per_layer = hw.with_terms(**{"layer_overhead_s": 40e-6})
    m = get_model("huginn-mid")
    for part in m.parts.values():  # the prelude, block and coda have 2, 4 and 2 layers
        base, more = (float(call_cost(m, h, part, "fp32", 1, 1, 1, 1).overhead_s)
                      for h in (hw, per_layer))
        assert more - base == pytest.approx(part.layers * 40e-6)
    ouro = get_model("ouro-mid")  # its prelude is the embedding alone: no layers
    assert float(call_cost(ouro, per_layer, ouro.part("prelude"), "fp32", 1, 1, 1, 1).overhead_s) \
        == pytest.approx(float(call_cost(ouro, hw, ouro.part("prelude"), "fp32", 1, 1, 1,
                                         1).overhead_s))


def test_a_cpu_attention_pays_for_each_key_set_and_head():
    """Each (key set, head) pair the attention works through costs a fixed time, with the KV:
    a batch of 16 waves of 8 reads 128 key sets over the same 8 slots."""
    m = get_model("huginn-mid")
    part = m.part("block")
    per_pair = _cpu(attention_key_set_s=2e-6)

    def cost(hw, key_sets):
        return call_cost(m, hw, part, "fp32", 128, 8, 128 * 100, key_sets * 100,
                         key_sets=key_sets)

    for key_sets in (8, 128):
        base, more = cost(_cpu(), key_sets), cost(per_pair, key_sets)
        extra = part.layers * m.num_heads * key_sets * 2e-6
        assert float(more.time_s - base.time_s) == pytest.approx(extra)
        assert float(more.kv_s - base.kv_s) == pytest.approx(extra)
        assert float(more.ideal_s) == float(base.ideal_s)  # not bytes or flops
    assert get_hardware("a6000").cpu is None  # no key-set term on a GPU


def test_a_cpu_call_after_another_parts_reads_its_weights_from_the_whole_models_working_set():
    # each part's weights fit the synthetic 16 MiB cache, the three together do not
    model = get_model("huginn-tiny").model_copy(update={"hidden_size": 384, "mlp_size": 1024,
                                                        "num_heads": 6, "num_kv_heads": 6})
    sizes = [p.weight_params * 4 for p in model.parts.values()]
    assert max(sizes) < 2**24 < sum(sizes)
    hw = _cpu()
    for name in ("prelude", "block", "coda"):
        part = model.part(name)
        warm, cold = (call_cost(model, hw, part, "fp32", 1, 1, 64, 64, after_other_part=after)
                      for after in (False, True))
        # 20 GB/s from memory, 200 from the cache: the whole model's 29 MiB lie between the
        # curve's cached 16 MiB and streamed 128 MiB
        assert cold.weights_s > 1.3 * warm.weights_s
        assert cold.overhead_s == warm.overhead_s and cold.kv_s == warm.kv_s
        mixed = call_cost(model, hw, part, "fp32", np.array([1, 1]), 1, 64, 64,
                          after_other_part=np.array([False, True]))
        assert list(mixed.time_s) == pytest.approx([warm.time_s, cold.time_s])
    # a model that fits the cache whole, and a GPU (no curve), price both alike
    tiny = get_model("huginn-tiny")
    for m, h in ((tiny, hw), (model, get_hardware("a6000"))):
        assert call_cost(m, h, m.part("block"), "fp32", 1, 1, 64, 64,
                         after_other_part=True).time_s == pytest.approx(
            call_cost(m, h, m.part("block"), "fp32", 1, 1, 64, 64).time_s)


@settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(MODELS), hw=st.sampled_from(HW), prompt=st.integers(1, 4096),
       readouts=st.integers(1, 8), batch=st.integers(1, 8))
def test_a_prompt_read_out_in_one_call_costs_no_more_than_a_call_a_depth(model, hw, prompt,
                                                                         readouts, batch):
    """The plugin's waves read a prompt out at all its readout depths in one coda call: the
    same positions and keys as a call per depth, the weights read and the kernels launched once,
    so never slower, and faster where weights and launches bound the coda; at one readout depth
    the same call."""
    from costmodel.predict import prefill_time_s
    from costmodel.workload import Workload

    spec, hardware = get_model(model), get_hardware(hw)
    workload = Workload(context_length=prompt, new_tokens=1, batch_size=batch)
    apart = prefill_time_s(spec, hardware, workload, 8, readouts)
    together = prefill_time_s(spec, hardware, workload, 8, readouts, readouts_together=True)
    assert together <= apart * (1 + 1e-12)
    if readouts == 1:
        assert together == apart
    elif prompt * batch <= 16:  # a few positions: the coda's weights and launches paid once
        assert together < apart
