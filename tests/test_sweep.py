import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from costmodel import Workload, get_hardware, get_model, predict, sweep


def test_sweep_agrees_with_predict_point_by_point():
    widths = np.array([2, 4, 8, 16, 32])
    alphas = np.array([0.5, 0.8, 0.94, 0.99, 1.0])
    contexts = np.array([128, 1024, 4096, 2048, 512])
    out = sweep("huginn-3.5b", "a6000", width=widths, acceptance=alphas, context=contexts,
                new_tokens=256)
    for i, (w, a, c) in enumerate(zip(widths, alphas, contexts, strict=True)):
        p = predict("huginn-3.5b", "a6000",
                    Workload(acceptance=float(a), context_length=int(c), new_tokens=256),
                    width=int(w))
        s = p.schedules
        assert out["ar_latency_s"][i] == pytest.approx(s["ar"].latency_per_token_s, rel=1e-12)
        assert out["wfd_latency_s"][i] == pytest.approx(s["wfd"].latency_per_token_s, rel=1e-12)
        assert out["dtv_latency_s"][i] == pytest.approx(s["dtv"].latency_per_token_s, rel=1e-12)
        assert out["dtv_block_length"][i] == s["dtv"].block_length


def test_sweep_broadcasts_bandwidth_and_batch():
    bw = np.array([[768e9], [3.35e12]])
    batch = np.array([[1, 8, 64]])
    out = sweep("ouro-2.6b", "a6000", bandwidth_bytes_per_s=bw, batch=batch)
    assert out["wfd_speedup"].shape == (2, 3)
    assert np.all(out["ar_latency_s"][1] < out["ar_latency_s"][0])


def test_sweep_rejects_impossible_widths():
    with pytest.raises(ValueError, match="width"):
        sweep("huginn-3.5b", width=np.array([0, 8]))


@pytest.mark.parametrize("kwargs, message", [
    ({"acceptance": np.array([0.5, np.nan])}, "acceptance"),
    ({"context": np.array([0, 1024])}, "context"),
    ({"batch": 0}, "batch"),
    ({"bandwidth_bytes_per_s": np.array([0.0, 1e12])}, "bandwidth"),
    ({"new_tokens": 0}, "new tokens"),
    ({"kv_sharing": -1}, "KV sharing"),
    ({"block_lengths": range(0, 4)}, "block lengths"),
    ({"dtype": "int4"}, "dtype"),
    ({"depth": 1, "width": 2}, "depth R"),
])
def test_sweep_refuses_what_has_no_price(kwargs, message):
    # each of these priced a silently wrong number (NaN, or a batch of none) or failed obscurely
    with pytest.raises(ValueError, match=message):
        sweep("huginn-3.5b", "a6000", **kwargs)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(["huginn-3.5b", "ouro-2.6b"]),
       st.sampled_from(["a6000", "h100-sxm", "h200", "rtx4090", "mi300x"]),
       st.sampled_from(["eager", "graphs"]), st.floats(0.0, 1.0), st.integers(1, 8192),
       st.integers(1, 16), st.integers(2, 1024), st.sampled_from([0, 1, 2]), st.data())
def test_a_swept_grid_is_predict_at_every_point(model, hardware, mode, alpha, context, batch,
                                                new_tokens, sharing, data):
    """The sweep prices each point as ``predict`` does, to 1e-9, whatever it sweeps: widths and
    acceptances with contexts and batches beside them (a grid, not one point)."""
    depth = get_model(model).default_depth
    width = data.draw(st.integers(2, depth))
    hw = get_hardware(hardware).in_mode(mode)
    grid = sweep(model, hw, width=np.array([[width], [depth]]),
                 acceptance=np.array([[alpha, 0.5 * alpha]]), context=np.array(context),
                 batch=np.array([[[batch]], [[1]]]), new_tokens=new_tokens,
                 kv_sharing=sharing)
    assert grid["ar_latency_s"].shape == (2, 2, 2)
    p = predict(model, hw, Workload(acceptance=alpha, context_length=context,
                                    new_tokens=new_tokens, batch_size=batch,
                                    kv_sharing=sharing), width=width)
    assume(p.memory.fits)
    s = p.schedules
    assert grid["ar_latency_s"][0, 0, 0] == pytest.approx(s["ar"].latency_per_token_s, rel=1e-9)
    assert grid["dtv_latency_s"][0, 0, 0] == pytest.approx(s["dtv"].latency_per_token_s,
                                                           rel=1e-9)
    assert grid["wfd_latency_s"][0, 0, 0] == pytest.approx(s["wfd"].latency_per_token_s,
                                                           rel=1e-9)
    assert grid["dtv_block_length"][0, 0, 0] == s["dtv"].block_length
    assert grid["draft_depth"][0, 0, 0] == s["wfd"].draft_depth
