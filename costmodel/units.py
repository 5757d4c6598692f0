"""Parse and format physical quantities: bandwidth, flop rates, memory sizes and durations.

SI prefixes are powers of 1000 (GB = 10^9 bytes), binary prefixes powers of 1024 (GiB = 2^30 bytes).
Parsing is exact: the number is read as a decimal and multiplied by an integer or decimal scale,
so 48GiB is exactly 51,539,607,552 bytes.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_SI = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_TIME = {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"),
         "μs": Decimal("1e-6"), "ns": Decimal("1e-9")}

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_BYTES_RE = re.compile(_NUMBER + r"(?P<prefix>Ki|Mi|Gi|Ti|Pi|[kKMGTP]?)(?P<unit>B)(?P<rate>/s)?$")
_FLOPS_RE = re.compile(_NUMBER + r"(?P<prefix>[kKMGTP]?)(?P<unit>FLOPS|FLOP/s|flops|flop/s)$")
_TIME_RE = re.compile(_NUMBER + r"(?P<unit>s|ms|us|µs|μs|ns)$")


class UnitError(ValueError):
    """A quantity that cannot be parsed, or has the wrong kind of unit."""


def _number(match: re.Match[str], text: str) -> Decimal:
    try:
        return Decimal(match.group("num"))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise UnitError(f"not a number in {text!r}") from exc


def _scale(prefix: str) -> int:
    return _BINARY[prefix] if prefix in _BINARY else _SI[prefix]


def _reject_sign(text: str, kind: str, example: str) -> str:
    stripped = text.strip()
    if stripped.startswith("-"):
        raise UnitError(f"{kind} must be positive, got {text!r}")
    if not stripped:
        raise UnitError(f"empty {kind}; expected something like {example}")
    return stripped


def _parse_scaled(text: str | float, kind: str, pattern: re.Pattern[str], examples: str,
                  rate: bool | None = None) -> float:
    """A positive quantity: a bare number, or a number with an SI or binary prefix and a unit
    (``rate`` says whether the unit must, or must not, end in /s)."""
    if isinstance(text, (int, float)):
        return _positive(float(text), kind)
    stripped = _reject_sign(text, kind, examples.split(",")[0])
    m = pattern.match(stripped)
    if not m or (rate is not None and bool(m.groupdict().get("rate")) != rate):
        raise UnitError(f"cannot read {kind} {text!r}; expected e.g. {examples}")
    return _positive(float(_number(m, text) * _scale(m.group("prefix"))), kind, repr(text))


def parse_bandwidth(text: str | float) -> float:
    """'768GB/s', '4.8TB/s', '1.5TiB/s' -> bytes per second. A bare number is bytes/s."""
    return _parse_scaled(text, "bandwidth", _BYTES_RE, "768GB/s, 4.8TB/s, 1TiB/s", rate=True)


def parse_bytes(text: str | float) -> float:
    """'48GB', '48GiB', '512MiB' -> bytes. A bare number is bytes."""
    return _parse_scaled(text, "memory size", _BYTES_RE, "48GB, 48GiB, 512MiB", rate=False)


def parse_flops(text: str | float) -> float:
    """'155TFLOPS', '989 TFLOP/s' -> floating-point operations per second."""
    return _parse_scaled(text, "flop rate", _FLOPS_RE, "155TFLOPS, 989TFLOP/s")


def parse_duration(text: str | float) -> float:
    """'5us', '1.2ms', '0.5s' -> seconds. Zero is allowed (no overhead)."""
    if isinstance(text, (int, float)):
        if not 0 <= text < math.inf:
            raise UnitError(f"duration must not be negative, got {text}")
        return float(text)
    stripped = _reject_sign(text, "duration", "5us")
    m = _TIME_RE.match(stripped)
    if not m:
        raise UnitError(f"cannot read duration {text!r}; expected e.g. 5us, 1.2ms, 0.5s")
    value = float(_number(m, text) * _TIME[m.group("unit")])
    if not math.isfinite(value):
        raise UnitError(f"duration must be finite, got {text!r}")
    return value


_RATE_RE = re.compile(_NUMBER + r"(?:/(?P<unit>s|min|h))?$")
_PER = {None: 1, "s": 1, "min": 60, "h": 3600}


def parse_rate(text: str | float) -> float:
    """'4/s', '240/min', '0.5' -> requests per second (a bare number is per second)."""
    if isinstance(text, (int, float)):
        return _positive(float(text), "request rate")
    stripped = _reject_sign(text, "request rate", "4/s")
    m = _RATE_RE.match(stripped)
    if not m:
        raise UnitError(f"cannot read request rate {text!r}; expected e.g. 4/s, 240/min, 0.5")
    return _positive(float(_number(m, text)) / _PER[m.group("unit")], "request rate", repr(text))


def _positive(value: float, kind: str, shown: str | None = None) -> float:
    """``value``, or a UnitError naming it as the user wrote it (``shown``)."""
    if not math.isfinite(value):
        raise UnitError(f"{kind} must be finite, got {shown or value}")
    if not value > 0:
        raise UnitError(f"{kind} must be positive, got {shown or value}")
    return value


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
