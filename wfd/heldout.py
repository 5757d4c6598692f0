"""Held-out bits per byte measured through the decoder, exits and their KV rule included: each
window decoded from its first byte by AR with teacher forcing (what a model card reports for a
rule, beside the uncached evaluation of wfd.train at fixed depths)."""

from __future__ import annotations

import math

import torch
from torch import nn

from costmodel.exits import ExitRule, depth_distribution

from .exits import log_probs
from .generate import generate
from .sampling import Sampling


class _TeacherForcing(Sampling):
    """Commits the text's next byte whatever the readout, and adds up its negative log-likelihood
    (a held-out evaluation run through the decoder, exits and their KV rule included)."""

    def __init__(self, text: list[int]):
        super().__init__()
        self.text, self.nll, self.count = text, 0.0, 0

    def choose(self, logits: torch.Tensor, position: int) -> int:
        target = self.text[position + 1]
        self.nll -= float(log_probs(logits)[target])
        self.count += 1
        return target


def held_out_bits(model: nn.Module, data: bytes, rule: ExitRule | None, *, windows: int = 8,
                  length: int = 256) -> dict[str, object]:
    """Bits per byte over ``windows`` windows of ``length`` bytes spread over ``data``, each
    decoded from its first byte by AR with ``rule`` (None: fixed depth R) and teacher forcing:
    every later byte is predicted at its own exit depth, attending over the KV its earlier bytes
    left. Also the mean exit depth and the exit depths' distribution."""
    step = max((len(data) - length - 1) // windows, 1)
    nll, count, depths = 0.0, 0, []
    for w in range(windows):
        text = list(data[w * step: w * step + length + 1])
        forcing = _TeacherForcing(text)
        res = generate(model, text[:1], max_new_tokens=length, sampling=forcing,
                       exit_rule=rule, record=False)
        nll += forcing.nll
        count += forcing.count
        depths += res.stats.get("exit_depths", [])
    out: dict[str, object] = {"bits_per_byte": nll / count / math.log(2)}
    if depths:
        out["mean_exit_depth"] = sum(depths) / len(depths)
        out["exit_depths"] = depth_distribution(depths)
    return out
