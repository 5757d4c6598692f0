import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodel.units import (
    UnitError,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("768GB/s", 768e9), ("4.8TB/s", 4.8e12), ("1TiB/s", 2**40), ("3.35 TB/s", 3.35e12),
     ("512MB/s", 512e6)],
)
def test_bandwidth(text, expected):
    assert parse_bandwidth(text) == expected


def test_bytes_si_and_binary_are_exact():
    assert parse_bytes("48GB") == 48_000_000_000
    assert parse_bytes("48GiB") == 51_539_607_552
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5KiB") == 1536


def test_flops_and_durations():
    assert parse_flops("155TFLOPS") == 155e12
    assert parse_flops("989 TFLOP/s") == 989e12
    assert parse_duration("5us") == pytest.approx(5e-6, rel=1e-15)
    assert parse_duration("1.2ms") == pytest.approx(1.2e-3, rel=1e-15)
    assert parse_duration("0s") == 0.0


@pytest.mark.parametrize(
    ("parser", "text"),
    [(parse_bandwidth, "768GB"), (parse_bandwidth, "-1GB/s"), (parse_bandwidth, "fast"),
     (parse_bytes, "48GB/s"), (parse_bytes, "0GB"), (parse_bytes, ""), (parse_flops, "155TB"),
     (parse_duration, "5 parsecs"), (parse_duration, "-5us"), (parse_bandwidth, "1e400GB/s")],
)
def test_malformed_quantities_are_rejected(parser, text):
    with pytest.raises(UnitError, match=f"'{text}'" if text else "empty"):  # as the user wrote it
        parser(text)


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["K", "M", "G", "T"]))
def test_binary_prefix_is_power_of_two(n, prefix):
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[prefix]
    assert parse_bytes(f"{n}{prefix}iB") == n * scale
