"""The training step's losses (readouts weighted zero are not computed, and nothing changes) and
the depth curriculum."""

import statistics
import sys

import pytest
import torch

from costmodel.presets import MODELS
from wfd.checkpoint import build, init_random
from wfd.config import ModelConfig
from wfd.train import forward_losses, main, ramped_mean_depth, sample_depth


def test_final_depth_only_gives_the_same_loss_and_gradients():
    model = init_random(build(ModelConfig.from_spec(MODELS["huginn-tiny"])), seed=0)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    grads, finals = [], []
    for intermediate in (True, False):
        model.zero_grad()
        losses = forward_losses(model, x, y, depth=5, backprop=3,
                                gen=torch.Generator().manual_seed(1), family="huginn",
                                intermediate=intermediate)
        assert len(losses) == (3 if intermediate else 1)
        losses[-1].backward()
        finals.append(losses[-1].item())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert finals[0] == finals[1]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_depth_ramp_rises_from_one_to_the_mean_then_holds():
    assert ramped_mean_depth(16, 0.5, 0.0) == 1
    assert ramped_mean_depth(16, 0.5, 0.25) == pytest.approx(8.5)
    assert ramped_mean_depth(16, 0.5, 0.5) == ramped_mean_depth(16, 0.5, 0.9) == 16
    assert ramped_mean_depth(16, 0.0, 0.0) == 16  # no ramp: Huginn's sampler from the start
    gen = torch.Generator().manual_seed(0)
    assert {sample_depth(ramped_mean_depth(16, 0.5, 0.0), 32, gen) for _ in range(50)} == {1}
    early = statistics.mean(sample_depth(ramped_mean_depth(16, 0.5, 0.1), 32, gen)
                            for _ in range(2000))
    assert early == pytest.approx(4, abs=0.3)


@pytest.mark.parametrize("flag, value", [("--minutes", "0"), ("--batch", "0"), ("--length", "0"),
                                         ("--lr", "-1"), ("--threads", "0"),
                                         ("--intermediate-weight", "-1")])
def test_numbers_training_cannot_use_are_refused_before_it_starts(flag, value, tmp_path,
                                                                  monkeypatch, capsys):
    # each gave a traceback, a NaN loss for the whole budget, or a model trained for no time;
    # `python -m wfd.train` runs main() (in this process: torch is imported already)
    monkeypatch.setattr(sys, "argv", ["wfd.train", "--family", "ouro", "--out",
                                      str(tmp_path / "m"), flag, value])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and f"{flag} must be" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
