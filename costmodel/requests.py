"""A stream of requests: when each arrives, its prompt's length and the tokens it asks for;
drawn at a rate (Poisson or evenly spaced arrivals, fixed or uniform lengths) or read from a JSON
Lines file. What ``costmodel.serving`` serves and ``bench/serving_load.py`` sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field, ValidationError

from .specs import Spec

ARRIVALS = ("poisson", "uniform")


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


def request_stream(rate_per_s: float, count: int, prompt: Lengths, output: Lengths, *,
                   arrivals: str = "poisson", seed: int = 0) -> list[Request]:
    """``count`` requests arriving at ``rate_per_s`` (Poisson: exponential gaps; uniform: evenly
    spaced), the first at 0, their lengths drawn from ``prompt`` and ``output`` (seeded)."""
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
    return [Request(arrival_s=float(t), prompt_tokens=p, output_tokens=o)
            for t, p, o in zip(times, prompt.draw(rng, count), output.draw(rng, count),
                               strict=True)]


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
