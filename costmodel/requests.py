"""A stream of requests: when each arrives, its prompt's length and the tokens it asks for;
drawn at a rate (Poisson or evenly spaced arrivals; fixed or uniform lengths, or pairs drawn from
a shipped distribution of real requests' lengths, ``LengthSample``) or read from a JSON Lines
file. What ``costmodel.serving`` serves and ``bench/serving_load.py`` sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field, ValidationError, model_validator

from .specs import Spec

ARRIVALS = ("poisson", "uniform")
LENGTHS_DIR = Path(__file__).resolve().parent / "data" / "lengths"


class Request(Spec):
    """One request of a stream: when it arrives, its prompt and the tokens it asks for."""

    arrival_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    prompt_tokens: Annotated[int, Field(ge=1)]
    output_tokens: Annotated[int, Field(ge=2)]  # the prefill commits the first


class Lengths(Spec):
    """A token count: fixed (low = high) or drawn uniformly from low..high."""

    low: Annotated[int, Field(ge=1)]
    high: Annotated[int, Field(ge=1)]

    @classmethod
    def parse(cls, text: str | int, what: str) -> Lengths:
        """'512' or '128-1024' (one line naming ``what`` otherwise)."""
        parts = str(text).split("-")
        try:
            low, high = int(parts[0]), int(parts[-1])
        except ValueError:
            raise ValueError(f"cannot read {what} {text!r}; expected e.g. 512 or "
                             "128-1024") from None
        if len(parts) > 2 or not 1 <= low <= high:
            raise ValueError(f"{what} must be N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
        return cls(low=low, high=high)

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        return [int(n) for n in rng.integers(self.low, self.high + 1, count)]

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


class LengthSample(Spec):
    """Prompt and output lengths of a trace of real requests, as a joint histogram (cells of
    ``prompt_edges`` x ``output_edges``, each with its count of requests): a pair is drawn by
    picking a cell by its count, then each length uniformly within the cell's bounds, so that
    long prompts keep the outputs they came with. ``bench/length_samples.py`` makes one."""

    name: str
    about: str
    source: str  # the trace it was made from, its licence
    requests: Annotated[int, Field(ge=1)]
    prompt_edges: list[Annotated[int, Field(ge=1)]]  # bin i: edges[i] <= tokens < edges[i + 1]
    output_edges: list[Annotated[int, Field(ge=1)]]
    cells: list[tuple[int, int, Annotated[int, Field(ge=1)]]]  # prompt bin, output bin, count

    @model_validator(mode="after")
    def _cells_within_edges(self) -> LengthSample:
        for edges, what in ((self.prompt_edges, "prompt"), (self.output_edges, "output")):
            if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
                raise ValueError(f"the {what} edges must be two or more, increasing")
        for i, j, _ in self.cells:
            if not (0 <= i < len(self.prompt_edges) - 1 and 0 <= j < len(self.output_edges) - 1):
                raise ValueError(f"cell ({i}, {j}) lies outside the edges")
        if sum(count for _, _, count in self.cells) != self.requests:
            raise ValueError(f"the cells count {sum(c for _, _, c in self.cells)} requests, "
                             f"not {self.requests}")
        return self

    @classmethod
    def names(cls) -> list[str]:
        return sorted(p.stem for p in LENGTHS_DIR.glob("*.json"))

    @classmethod
    def load(cls, name: str) -> LengthSample:
        """A shipped sample by name, or one from a JSON file; one line otherwise."""
        path = Path(name) if name.endswith(".json") else LENGTHS_DIR / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"unknown length sample {name!r}; shipped: "
                             f"{', '.join(cls.names())} (or a .json file of the same form)")
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as exc:
            from .errors import validation_message

            raise ValueError(f"{path}: {validation_message(exc)}") from None

    def _bounds(self, context: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Each cell's [low, high) bounds (prompt, then output; outputs of at least 2 tokens,
        as a request asks for) and its weight: its count times the share of its pairs that fit
        ``context`` tokens (prompt plus output; None: all)."""
        cells = np.array(self.cells, dtype=np.int64).reshape(-1, 3)
        p_edges, o_edges = np.array(self.prompt_edges), np.array(self.output_edges)
        bounds = np.stack([p_edges[cells[:, 0]], p_edges[cells[:, 0] + 1],
                           np.maximum(o_edges[cells[:, 1]], 2),
                           np.maximum(o_edges[cells[:, 1] + 1], 3)], axis=1)
        share = np.ones(len(cells))
        if context is not None:
            for i, (p0, p1, o0, o1) in enumerate(bounds):
                prompts = np.arange(p0, p1)
                fitting = np.clip(context - prompts + 1, o0, o1) - o0
                share[i] = fitting.sum() / ((p1 - p0) * (o1 - o0))
        return bounds, cells[:, 2] * share

    def fitting_share(self, context: int) -> float:
        """The share of the trace's requests whose prompt and output fit ``context`` tokens."""
        return float(self._bounds(context)[1].sum() / self._bounds(None)[1].sum())

    def draw(self, rng: np.random.Generator, count: int, context: int | None = None
             ) -> tuple[list[int], list[int]]:
        """``count`` (prompt, output) pairs, as lists; with ``context``, of the requests that
        fit it (the trace's others left out, as an engine refuses them)."""
        bounds, weights = self._bounds(context)
        if not weights.sum() > 0:
            raise ValueError(f"no request of {self.name} fits a context of {context} tokens")
        chosen = bounds[rng.choice(len(bounds), count, p=weights / weights.sum())]
        prompts = rng.integers(chosen[:, 0], chosen[:, 1])
        outputs = rng.integers(chosen[:, 2], chosen[:, 3])
        while context is not None and (over := prompts + outputs > context).any():
            prompts[over] = rng.integers(chosen[over, 0], chosen[over, 1])
            outputs[over] = rng.integers(chosen[over, 2], chosen[over, 3])
        return prompts.tolist(), outputs.tolist()

    def mean_tokens(self) -> tuple[float, float]:
        """The mean prompt and output lengths it draws."""
        bounds, weights = self._bounds(None)
        means = (bounds[:, [0, 2]] + bounds[:, [1, 3]] - 1) / 2
        return tuple(float(m) for m in weights @ means / weights.sum())


def request_stream(rate_per_s: float, count: int, prompt: Lengths, output: Lengths, *,
                   arrivals: str = "poisson", seed: int = 0,
                   lengths: LengthSample | None = None, context: int | None = None
                   ) -> list[Request]:
    """``count`` requests arriving at ``rate_per_s`` (Poisson: exponential gaps; uniform: evenly
    spaced), the first at 0, their lengths drawn from ``prompt`` and ``output``, or in pairs
    from ``lengths`` (of its requests that fit ``context`` tokens); seeded."""
    if not rate_per_s > 0 or not np.isfinite(rate_per_s):
        raise ValueError(f"the request rate must be positive, got {rate_per_s}")
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {arrivals!r}; use {' or '.join(ARRIVALS)}")
    if output.low < 2:
        raise ValueError(f"each request asks for at least 2 tokens, got {output.low}")
    rng = np.random.default_rng(seed)
    gaps = (rng.exponential(1 / rate_per_s, count) if arrivals == "poisson"
            else np.full(count, 1 / rate_per_s))
    times = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    prompts, outputs = lengths.draw(rng, count, context) if lengths is not None else (
        prompt.draw(rng, count), output.draw(rng, count))
    return [Request(arrival_s=float(t), prompt_tokens=p, output_tokens=o)
            for t, p, o in zip(times, prompts, outputs, strict=True)]


def read_requests(path: str | Path) -> list[Request]:
    """A JSON Lines file of requests (``arrival_s``, ``prompt_tokens``, ``output_tokens``), in
    order of arrival; one line naming the first bad one."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(Request.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as exc:
            from .errors import validation_message

            why = validation_message(exc) if isinstance(exc, ValidationError) else exc.msg
            raise ValueError(f"{path}, line {number}: {why}") from None
    if not requests:
        raise ValueError(f"{path} holds no request")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
        raise ValueError(f"{path}: the requests must be in order of arrival")
    return requests


def check_fits(requests: list[Request], context: int) -> None:
    """Every request's prompt and output within ``context`` tokens (the model's): one line
    naming the first that is not (an engine refuses it; a simulation would price a sequence
    the model cannot hold)."""
    for number, r in enumerate(requests, 1):
        if r.prompt_tokens + r.output_tokens > context:
            raise ValueError(f"request {number} of the stream (arriving at {r.arrival_s:g} s): "
                             f"a prompt of {r.prompt_tokens} tokens plus {r.output_tokens} new "
                             f"ones exceeds the model's context of {context}")
