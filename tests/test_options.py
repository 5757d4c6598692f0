"""The run object (wfd.options.RunOptions): what it refuses before any model loads, and that a
decode given one equals a decode given the same settings as keywords."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wfd.options import GenerationError, RunOptions


@pytest.mark.parametrize(("settings", "message"), [
    ({"depth": 0}, "depth: .* 1, got 0"),
    ({"schedule": "beam"}, "unknown schedule 'beam'; use ar, dtv, wfd or auto"),
    ({"temperature": float("nan")}, "temperature: .*finite"),
    ({"top_p": 0}, "top_p"),
    ({"mode": "fast"}, "'eager', 'static' or 'graphs', got 'fast'"),
    ({"dtype": "int4"}, "dtype"),
    ({"width": 4, "draft_depth": 2}, "either a width or a draft depth"),
    ({"width": 1}, "width"),
    ({"min_depth": 2}, "goes with an exit rule"),
    ({"exit_rule": "kl", "min_depth": 9, "depth": 8}, r"in 1\.\.8, got 9"),
    ({"exit_rule": "kl:0"}, "positive finite"),
    ({"exit_rule": "kl", "force_exits": "4:1"}, "not both"),
    ({"schedule": "ar", "draft_rule": "kl:0.1"}, "schedule that drafts"),
    ({"schedule": "wfd", "draft_rule": "median"}, "draft rule: unknown exit rule"),
    ({"schedule": "auto", "exit_rule": "kl"}, "fixed-depth"),
    ({"schedule": "auto", "force_acceptance": 0.5}, "forced"),
    ({"force_acceptance": 1.5}, "force_acceptance"),
    ({"block_size": 4}, "block_size"),  # a misspelt setting is not ignored
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(GenerationError, match=message) as caught:
        RunOptions.of(settings=settings)
    assert "\n" not in str(caught.value)


@given(st.integers(1, 64), st.sampled_from(["ar", "dtv", "wfd"]), st.integers(1, 8))
def test_settings_over_options_replace_only_what_they_name(depth, schedule, block_length):
    base = RunOptions(schedule=schedule, depth=depth, temperature=0.5)
    merged = RunOptions.of(base, {"block_length": block_length})
    assert merged.block_length == block_length
    assert (merged.schedule, merged.depth, merged.temperature) == (schedule, depth, 0.5)
    assert RunOptions.of(base) == base


def test_rules_given_as_text_are_parsed_and_forced_exits_drawn_at_the_run_s_depth():
    options = RunOptions(schedule="wfd", exit_rule="kl:0.01", min_depth=3,
                         draft_rule="entropy-diff")
    assert (options.exit_rule.name, options.exit_rule.threshold, options.exit_rule.min_depth) \
        == ("kl", 0.01, 3)
    assert options.draft_rule.name == "entropy-diff" and options.drafts
    forced = RunOptions(force_exits="2:0.5,4:0.5", seed=3).rule(4)
    assert forced.distribution == ((2, 0.5), (4, 0.5)) and forced.seed == 3
    with pytest.raises(GenerationError, match="forced exits"):
        RunOptions(force_exits="9:1").rule(4)


def test_the_run_object_loads_no_torch():
    code = "import sys, wfd.options; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_decode_given_the_run_object_equals_one_given_keywords():
    from conftest import tiny_model

    from wfd import decode_batch, generate
    from wfd.batch import Request

    model = tiny_model("huginn")
    options = RunOptions(schedule="wfd", max_new_tokens=6, depth=4, draft_depth=1,
                         temperature=1.0, seed=5)
    by_object = generate(model, [3, 4, 5], options)
    by_keywords = generate(model, [3, 4, 5], schedule="wfd", max_new_tokens=6, depth=4,
                           draft_depth=1, temperature=1.0, seed=5)
    assert by_object.tokens == by_keywords.tokens and len(by_object.tokens) == 6
    assert by_object.stats["draft_depth"] == 1
    batch = decode_batch(model, [Request(0, [3, 4, 5], 6)], options, batch_size=1)
    assert batch.results[0].tokens == by_object.tokens
    with pytest.raises(GenerationError, match="the model is in fp32"):
        generate(model, [3, 4, 5], options, dtype="bf16")


def test_a_draft_depth_or_width_the_depth_cannot_have_is_refused_whatever_the_schedule():
    """AR drafts nothing, yet a draft depth at or past R (or a width past it) is a mistake to
    say, not to ignore; one it could have runs AR as asked."""
    from conftest import tiny_model

    from wfd import generate

    model = tiny_model("huginn")
    for schedule in ("ar", "dtv", "wfd"):
        with pytest.raises(GenerationError, match=r"draft depth must be in 1\.\.3"):
            generate(model, [3, 4, 5], schedule=schedule, max_new_tokens=2, depth=4,
                     draft_depth=4)
        with pytest.raises(GenerationError, match=r"width must be in 2\.\.4"):
            generate(model, [3, 4, 5], schedule=schedule, max_new_tokens=2, depth=4, width=9)
    plain = generate(model, [3, 4, 5], schedule="ar", max_new_tokens=2, depth=4)
    assert generate(model, [3, 4, 5], schedule="ar", max_new_tokens=2, depth=4,
                    draft_depth=2).tokens == plain.tokens
