import numpy as np
import pytest

from costmodel import Workload, predict, sweep


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
