"""Captured execution: each distinct call shape run from static buffers, captured once as a CUDA
graph and replayed (``--mode graphs``), or called on the same static buffers without capture
(``--mode static``, any device: the code path the CPU tests exercise).

A call's shape is its part and its slots (one per position, so the number of positions too). The
schedules use a bounded set of them, fixed by R, d and k, never by the context: the attention reads
the cache's static length under a mask, so a growing context changes only the values in the
buffers. ``captures`` counts the shapes prepared, ``replays`` the calls served; a run whose
``captures`` grows with the number of tokens would be re-capturing (the tests check it does not).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

WARMUP_CALLS = 2  # eager runs on a side stream before capture (lazy kernel and workspace setup)


@dataclass
class Captured:
    inputs: list[torch.Tensor]  # static buffers the inputs are copied into
    output: torch.Tensor | None  # the captured output buffer (graphs), else None
    graph: object | None  # torch.cuda.CUDAGraph


class CallGraphs:
    """Static buffers (and, with ``capture``, a CUDA graph) per call shape."""

    def __init__(self, capture: bool, device: torch.device):
        if capture and not torch.cuda.is_available():
            raise RuntimeError("graphs mode needs a CUDA device; on a CPU use --mode eager or "
                               "--mode static")
        self.capture, self.device = capture, device
        self.entries: dict[tuple, Captured] = {}
        self.replays = 0
        self.capture_s = 0.0  # capture and warm-up, excluded from the run's tokens/s
        self._pool = None

    def run(self, key: tuple, fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
            measure: Callable) -> tuple[torch.Tensor, float]:
        """Copy ``inputs`` into the shape's buffers, run (or replay) ``fn`` on them under
        ``measure``; returns (a copy of the output, the measured seconds)."""
        entry = self.entries.get(key)
        fresh = entry is None
        if fresh:
            entry = self._prepare(key, fn, inputs)
        self.replays += 1

        def replay() -> torch.Tensor:
            if not fresh:  # the inputs go in as part of the call (a prepared shape has them)
                for buffer, x in zip(entry.inputs, inputs, strict=True):
                    buffer.copy_(x, non_blocking=True)
            if entry.graph is None:
                return fn(*entry.inputs).clone()
            entry.graph.replay()
            return entry.output.clone()

        return measure(replay)

    def _prepare(self, key: tuple, fn: Callable[..., torch.Tensor],
                 inputs: list[torch.Tensor]) -> Captured:
        start = time.perf_counter()
        buffers = [x.to(self.device, copy=True) for x in inputs]
        graph = output = None
        if self.capture:
            # warm-up and capture run the same call on the same inputs: the KV they write is the
            # KV the call itself writes, so the cache is unchanged by capturing
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    fn(*buffers)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                output = fn(*buffers)
            self._pool = graph.pool()
            torch.cuda.synchronize()
        self.entries[key] = entry = Captured(buffers, output, graph)
        self.capture_s += time.perf_counter() - start
        return entry

    @property
    def captures(self) -> int:
        return len(self.entries)

    def stats(self) -> dict[str, float | int]:
        return {"shapes_captured": self.captures, "replays": self.replays,
                "capture_s": self.capture_s}
