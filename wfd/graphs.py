"""Captured execution: each distinct call shape run from static buffers, captured once as a CUDA
graph and replayed (``--mode graphs``), or called on the same static buffers without capture
(``--mode static``, any device: the code path the CPU tests exercise).

A shape is a call's part, its slots and its static span (the keys attention reads under a mask,
rounded up to whole blocks of ``costmodel.slots.STATIC_SPAN_KEYS``). Graphs bake in the addresses
they read, the KV cache's among them, so a model's static cache and its shapes live together in
a ``Workspace`` that later runs in the process reuse (docs/decoding.md, "Execution modes").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .sampling import GenerationError

WARMUP_CALLS = 2  # eager runs on the capture stream before capture (lazy kernel, workspace setup)


@dataclass
class Captured:
    staging: torch.Tensor  # host ints (positions, then a prelude's tokens), pinned on CUDA
    staged: object  # a numpy view of ``staging``: written without dispatching an operation
    ints: torch.Tensor  # their device copy, what the call reads
    inputs: list[torch.Tensor]  # device buffers the tensor inputs are copied into
    fn: Callable[..., torch.Tensor]  # the call, as prepared: static mode runs it, graphs replay
    output: torch.Tensor | None  # the captured output buffer (graphs), else None
    graph: object | None  # torch.cuda.CUDAGraph
    constants: list[torch.Tensor] = field(default_factory=list)  # device tensors made once
    copied: object | None = None  # CUDA event after the last copy-in (staging free to rewrite)


@dataclass
class Usage:
    """What one run did with a set of graphs: shapes it prepared, shapes it found prepared,
    calls served, and the seconds preparing took (excluded from the run's time)."""

    made: set = field(default_factory=set)
    reused: set = field(default_factory=set)
    replays: int = 0
    capture_s: float = 0.0

    def stats(self) -> dict[str, float | int]:
        return {"shapes_captured": len(self.made | self.reused),
                "captures_made": len(self.made), "captures_reused": len(self.reused),
                "replays": self.replays, "capture_s": self.capture_s}


class CallGraphs:
    """Static buffers (and, with ``capture``, a CUDA graph) per call shape, captured on a stream
    of their own (each set of graphs its own, so no set's cuBLAS workspace is another's)."""

    def __init__(self, capture: bool, device: torch.device):
        if capture and not torch.cuda.is_available():
            raise GenerationError("graphs mode needs a CUDA device; on a CPU use --mode eager "
                                  "or --mode static")
        self.capture, self.device = capture, device
        self.cuda = device.type == "cuda"
        self.entries: dict[tuple, Captured] = {}
        self.stream = torch.cuda.Stream(device) if capture else None
        self._pool = None
        self.usage = Usage()

    def start_run(self) -> Usage:
        """Count a new run's usage from here (the shapes stay)."""
        self.usage = Usage()
        return self.usage

    def run(self, key: tuple, fn: Callable[..., torch.Tensor], ints: Sequence[int],
            inputs: list[torch.Tensor], measure: Callable,
            constants: Callable[[], list[torch.Tensor]] = list) -> tuple[torch.Tensor, float]:
        """Run (or replay) the shape ``key``'s call, ``fn(device ints, *constants, *input
        buffers)`` as first prepared (a later ``fn`` is ignored, as a captured graph ignores it),
        under ``measure``, after copying ``ints`` (host integers) and ``inputs`` (device tensors)
        into the shape's buffers; returns (a copy of the output, the measured seconds).
        ``constants()`` makes the device tensors a shape keeps for good (made once, when the
        shape is prepared)."""
        entry = self.entries.get(key)
        if entry is None:
            start = time.perf_counter()
            entry = self._prepare(key, fn, ints, inputs, constants())
            self.usage.capture_s += time.perf_counter() - start
            self.usage.made.add(key)
            prepared = True
        else:
            if key not in self.usage.made:
                self.usage.reused.add(key)
            prepared = False
        self.usage.replays += 1

        def replay() -> torch.Tensor:
            if not prepared:  # a new shape's buffers already hold this call's inputs
                self._copy_in(entry, ints, inputs)
            if entry.graph is None:  # the prepared call, as a graph would replay it
                return entry.fn(entry.ints, *entry.constants, *entry.inputs).clone()
            entry.graph.replay()
            return entry.output.clone()

        return measure(replay)

    def _copy_in(self, entry: Captured, ints: Sequence[int], inputs: list[torch.Tensor]) -> None:
        if entry.copied is not None:
            entry.copied.synchronize()  # the last transfer from the staging buffer is done
        entry.staged[:] = ints  # no tensor built: the values written in place
        entry.ints.copy_(entry.staging, non_blocking=True)
        if self.cuda:
            entry.copied = torch.cuda.Event()
            entry.copied.record()
        for buffer, x in zip(entry.inputs, inputs, strict=True):
            buffer.copy_(x, non_blocking=True)

    def _prepare(self, key: tuple, fn: Callable[..., torch.Tensor], ints: Sequence[int],
                 inputs: list[torch.Tensor], constants: list[torch.Tensor]) -> Captured:
        staging = torch.tensor(list(ints), dtype=torch.long, pin_memory=self.cuda)
        entry = Captured(staging=staging, staged=staging.numpy(),
                         ints=staging.to(self.device, copy=True),
                         inputs=[x.to(self.device, copy=True) for x in inputs], fn=fn,
                         output=None, graph=None, constants=constants)
        if self.capture:
            # warm-up and capture run the same call on the same inputs: the KV they write is the
            # KV the call itself writes, so the cache is unchanged by capturing
            args = (entry.ints, *constants, *entry.inputs)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_CALLS):
                    fn(*args)
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                entry.output = fn(*args)
            entry.graph = graph
            self._pool = graph.pool()
            torch.cuda.synchronize()
        self.entries[key] = entry
        return entry


@dataclass
class Workspace:
    """A model's static KV cache and the call shapes prepared on it, kept for later runs."""

    cache: object  # wfd.cache.KVCache
    graphs: CallGraphs


def workspaces(model: torch.nn.Module) -> dict[tuple, Workspace]:
    """The model's workspaces by (mode, cache layout). Kept on the model, so they last as long
    as it does (the graphs hold the model's parts)."""
    return model.__dict__.setdefault("_workspaces", {})


def drop_workspaces(model: torch.nn.Module, layouts: list[tuple] | None = None) -> None:
    """Free the model's workspaces (those of ``layouts``; all by default) and, on CUDA, the
    memory they held."""
    spaces = workspaces(model)
    for key in list(spaces) if layouts is None else layouts:
        spaces.pop(key, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
