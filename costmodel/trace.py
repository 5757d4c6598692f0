"""Traces: the bridge between the decoder (measured) and the simulator (predicted).

Both are JSON Lines: a header line, then one record per line.

- Call trace: one ``CallRecord`` per call of P, B or C: the positions, the depth each position
  has after the call (B), or is read out at (C), the context each position attends over, the KV
  slot each position reads and writes, and the wall time (measured or predicted). A batched
  call also names the sequence (its KV region) of each position; a slot is then read once per
  sequence that uses it.
- Depth trace: one ``DepthRecord`` per generated position p: the greedy readout y(p, r) and its
  top-1 probability at every depth r = 1..R. It tells whether draft depth d would be accepted at
  p, for every d, so the simulator can replay any schedule without the model.

Writes are atomic: a temporary file in the same folder, then a rename.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import TraceError  # noqa: F401 (importers name it here)

TRACE_SCHEMA_VERSION = 1


class TraceHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    schema_version: int = TRACE_SCHEMA_VERSION
    trace: Literal["calls", "depths"]
    source: Literal["measured", "predicted"]
    model: str
    device: str
    dtype: str
    commit: str = "unknown"
    depth: int = Field(description="full recurrence depth R")
    prompt_length: int = 0
    schedule: str = "ar"
    extra: dict[str, object] = Field(default_factory=dict)


class CallRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    kind: Literal["prelude", "block", "coda"]
    positions: list[int]
    depths: list[int]
    contexts: list[int]
    slots: list[int]
    sequences: list[int] | None = None  # a batched call: each position's sequence
    wall_s: float = 0.0

    def slot_contexts(self) -> dict[int | tuple[int, int], int]:
        return slot_lengths(self.slots, self.contexts, self.sequences)


def slot_lengths(slots: Sequence[int], contexts: Sequence[int],
                 sequences: Sequence[int] | None = None) -> dict[int | tuple[int, int], int]:
    """Length of each distinct slot a call reads (each (sequence, slot) of a batched call): the
    longest context among its readers."""
    keys = slots if sequences is None else list(zip(sequences, slots, strict=True))
    lengths: dict[int | tuple[int, int], int] = {}
    for key, ctx in zip(keys, contexts, strict=True):
        lengths[key] = max(lengths.get(key, 0), ctx)
    return lengths


class DepthRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    position: int
    token: int = Field(description="the token committed from this position (y at depth R)")
    predictions: list[int] = Field(description="greedy readout y(p, r) for r = 1..R")
    top1_prob: list[float]
    # what the exit rules read at each depth r = 1..R (costmodel.exits); absent in older traces
    kl_step: list[float] | None = Field(None, description="KL(y(p, r-1) || y(p, r)); r = 1: "
                                        "from the uniform distribution")
    kl_start: list[float] | None = Field(None, description="KL(uniform || y(p, r))")
    entropy: list[float] | None = Field(None, description="entropy of y(p, r), nats")
    latent_step: list[float] | None = Field(None, description="|h_r - h_r-1| / |h_r|")
    latent_start: list[float] | None = Field(None, description="|h_r - h_0| / |h_r|")
    exit_lambda: list[float] | None = Field(None, description="the exit gate's hazard at r")


class DepthTrace(BaseModel):
    header: TraceHeader
    records: list[DepthRecord]

    def acceptance_sequence(self, draft_depth: int) -> list[bool]:
        """Whether the draft read out at ``draft_depth`` equals the full-depth readout, for each
        decoded position in order (the prefill's readout, which commits the first token without a
        draft, is skipped)."""
        depth = self.header.depth
        if not 1 <= draft_depth < depth:
            raise TraceError(f"draft depth {draft_depth} outside 1..{depth - 1}")
        return [rec.predictions[draft_depth - 1] == rec.predictions[depth - 1]
                for rec in self.records if rec.position >= self.header.prompt_length]

    def acceptance_by_depth(self) -> dict[int, float]:
        """The acceptance of every draft depth 1..R-1 over the decoded positions."""
        return {d: self.acceptance(d) for d in range(1, self.header.depth)}

    def exit_depths(self, rule) -> list[int]:
        """The depth each decoded position exits at under ``rule`` (costmodel.exits.ExitRule),
        in order: what the simulator replays for adaptive depth."""
        depth = self.header.depth
        return [rule.exit_depth(rec, depth) for rec in self.records
                if rec.position >= self.header.prompt_length]

    def exit_pairs(self, rule, draft_depth: int) -> list[tuple[int, bool]]:
        """Per decoded position under ``rule``: its exit depth e, and whether its draft at
        ``draft_depth`` equals its final readout y(p, e)."""
        decoded = [rec for rec in self.records if rec.position >= self.header.prompt_length]
        return [(e, rec.predictions[min(draft_depth, e) - 1] == rec.predictions[e - 1])
                for rec, e in zip(decoded, self.exit_depths(rule), strict=True)]

    def acceptance(self, draft_depth: int) -> float:
        seq = self.acceptance_sequence(draft_depth)
        if not seq:
            raise TraceError("the depth trace has no decoded positions")
        return sum(seq) / len(seq)


def current_commit() -> str:
    """The project's git commit, for stamping traces and profiles ("unknown" outside git), with
    "-dirty" when tracked files differ from it: a copy of the tree made elsewhere (a lent GPU
    machine's) can carry an older commit's git metadata."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` (text, or bytes such as a figure's) to ``path`` all at once or not at all:
    a temporary file beside it, renamed over it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:  # named by the file asked for, not by its folder or temporary twin
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}", str(path)) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a written file reads like any other
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl(path: str | os.PathLike[str], header: TraceHeader,
                records: Iterable[BaseModel]) -> None:
    lines = [header.model_dump_json()] + [r.model_dump_json() for r in records]
    atomic_write(path, "\n".join(lines) + "\n")


def _read_lines(path: str | os.PathLike[str]) -> tuple[TraceHeader, list[str]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not text (a trace is JSON Lines)") from None
    if not lines:
        raise TraceError(f"trace {path} is empty")
    try:
        raw = json.loads(lines[0])
    except json.JSONDecodeError:
        raise TraceError(f"trace {path}: the header line is not JSON") from None
    if not isinstance(raw, dict) or raw.get("schema_version") != TRACE_SCHEMA_VERSION:
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        raise TraceError(f"trace {path} has schema version {version!r}; "
                         f"this version reads {TRACE_SCHEMA_VERSION}")
    try:
        header = TraceHeader.model_validate(raw)
    except ValidationError as exc:
        raise TraceError(f"trace {path}: bad header ({exc.error_count()} errors)") from None
    return header, [line for line in lines[1:] if line.strip()]


def _records(path: str | os.PathLike[str], lines: Sequence[str], cls: type[BaseModel]) -> list:
    out = []
    for number, line in enumerate(lines, start=2):
        try:
            out.append(cls.model_validate_json(line))
        except ValidationError:
            raise TraceError(f"trace {path}: line {number} is not a valid {cls.__name__}") from None
    return out


def read_call_trace(path: str | os.PathLike[str]) -> tuple[TraceHeader, list[CallRecord]]:
    header, lines = _read_lines(path)
    if header.trace != "calls":
        raise TraceError(f"{path} is a {header.trace} trace, not a call trace")
    return header, _records(path, lines, CallRecord)


def read_depth_trace(path: str | os.PathLike[str]) -> DepthTrace:
    header, lines = _read_lines(path)
    if header.trace != "depths":
        raise TraceError(f"{path} is a {header.trace} trace, not a depth trace")
    records = _records(path, lines, DepthRecord)
    short = next((r for r in records if len(r.predictions) != header.depth), None)
    if short is not None:  # every reader indexes depths 1..R
        raise TraceError(f"trace {path}: position {short.position} is read out at "
                         f"{len(short.predictions)} depths, not R = {header.depth} (a depth trace "
                         "reads every position out at every depth)")
    return DepthTrace(header=header, records=records)
