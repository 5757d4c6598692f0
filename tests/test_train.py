"""The training step's losses: readouts weighted zero are not computed, and nothing changes."""

import torch

from costmodel.presets import MODELS
from wfd.checkpoint import build, init_random
from wfd.config import ModelConfig
from wfd.train import forward_losses


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
