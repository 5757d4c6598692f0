"""`costmodel recommend` and `wfd generate --schedule auto`: the search, its agreement with
`predict`, its extremes, bad input, and a decoder that runs what it chooses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import model_for, tiny_model

from costmodel import Workload, get_hardware, get_model, predict, recommend, simulate
from costmodel.profile import load_profile
from costmodel.recommend import QUICK_DEPTHS, parse_acceptance_by_depth
from costmodel.trace import DepthRecord, TraceHeader, write_jsonl
from wfd.generate import GenerationError, generate

CPU_PROFILE = "costmodel/data/profiles/cpu-huginn-fp32.json"


def test_the_finalists_are_priced_by_the_simulator_and_agree_with_predict():
    acceptance = {1: 0.7, 2: 0.85, 4: 0.94, 8: 0.98}
    workload = Workload(context_length=1024, new_tokens=512)
    for choice in recommend("huginn-3.5b", "a6000", acceptance, workload, top=3):
        sim = simulate(get_model("huginn-3.5b"), get_hardware("a6000"), choice.schedule_spec(),
                       context_length=1024 + (512 - 160) // 2, new_tokens=160,
                       acceptance=choice.acceptance or 0.0, seed=0)
        assert choice.latency_per_token_s == pytest.approx(sim.latency_per_token_s, rel=1e-12)
        # and the closed forms the search ranked by are near it
        closed = predict("huginn-3.5b", "a6000", workload.model_copy(
            update={"acceptance": choice.acceptance}), draft_depth=choice.draft_depth,
            block_length=choice.block_length, width_cap=choice.width_cap)
        assert closed.schedules[choice.schedule].latency_per_token_s == pytest.approx(
            choice.latency_per_token_s, rel=0.15)


def test_extremes():
    hw = get_hardware("h100-sxm")
    never = recommend("huginn-3.5b", hw, {d: 0.0 for d in range(1, 32)}, top=1)[0]
    assert never.schedule == "ar"
    # every draft accepted, at a short context (the weights, not the 32 slots' KV, dominate):
    # the widest wave streams the block's weights once per token
    always = recommend("huginn-3.5b", hw, {d: 1.0 for d in range(1, 32)},
                       Workload(context_length=32, new_tokens=64), top=3)
    assert always[0].schedule == "wfd" and always[0].draft_depth == 1
    assert always[0].speedup_vs_ar > 5  # 32 block calls per token against about 1
    ranked = [c.latency_per_token_s for c in always]
    assert ranked == sorted(ranked)


def test_the_best_draft_depth_follows_the_acceptance_curve():
    steep = recommend("huginn-3.5b", "a6000", {1: 0.3, 2: 0.5, 4: 0.95, 8: 0.97}, top=1)[0]
    assert steep.draft_depth == 4


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="outside 1..31"):
        recommend("huginn-3.5b", "a6000", {32: 0.9})
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        recommend("huginn-3.5b", "a6000", {4: 1.2})
    with pytest.raises(ValueError, match="empty trace"):
        recommend("huginn-3.5b", "a6000", {})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "costmodel", "recommend", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_json_and_bad_input(tmp_path):
    out = _cli("--acceptance-by-depth", "1:0.6,4:0.94", "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert len(payload["choices"]) == 3 and payload["choices"][0]["flags"].startswith(
        "--schedule ")
    header = dict(source="measured", model="m", device="cpu", dtype="fp32", depth=4,
                  prompt_length=2)
    other = tmp_path / "other.jsonl"  # a depth trace of a model at R = 4
    write_jsonl(other, TraceHeader(trace="depths", **header),
                [DepthRecord(position=2, token=1, predictions=[1, 1, 1, 1], top1_prob=[1] * 4)])
    empty = tmp_path / "empty.jsonl"
    write_jsonl(empty, TraceHeader(trace="depths", **header), [])
    for args in (("--acceptance-by-depth", "1:1.5"), ("--acceptance-by-depth", "40:0.9"),
                 ("--acceptance-by-depth", "four"), ("--depth-trace", str(other)),
                 ("--model", "ouro-2.6b", "--depth-trace", str(empty)), ()):
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stdout)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_depth_given_twice_is_refused():
    # the last of the two was taken without a word
    assert parse_acceptance_by_depth("1:0.6, 4:0.9") == {1: 0.6, 4: 0.9}
    with pytest.raises(ValueError, match="gives depth 1 twice"):
        parse_acceptance_by_depth("1:0.6,4:0.9,1:0.7")


def test_a_context_that_does_not_fit_is_predict_s_verdict_and_exit_code():
    # recommend left out the drafts' lookahead (33 tokens more fitted) and exited 2
    fits = predict("huginn-3.5b", "a6000", Workload(context_length=1024)).memory.max_context
    edge = fits - 512  # the longest prompt that fits with 512 new tokens
    recommend("huginn-3.5b", "a6000", {4: 0.9}, Workload(context_length=edge))
    with pytest.raises(ValueError, match=f"at most {fits:,} tokens"):
        recommend("huginn-3.5b", "a6000", {4: 0.9}, Workload(context_length=edge + 1))
    out = _cli("--acceptance-by-depth", "4:0.9", "--context", str(edge + 1))
    assert out.returncode == 1 and out.stderr.startswith("error: on a6000"), out.stderr


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_auto_runs_what_it_chooses_and_stays_exact(family):
    model = model_for(family, True)
    hw = load_profile(CPU_PROFILE).hardware
    prompt = [5, 9, 33, 2, 17, 8, 40, 1]
    auto = generate(model, prompt, schedule="auto", max_new_tokens=20, hardware=hw)
    decision = auto.stats["auto"]
    assert auto.schedule in ("ar", "dtv", "wfd") and decision["flags"].startswith(
        f"--schedule {auto.schedule}")
    # the probe read the prompt out at the draft depths the quick search tries
    assert set(decision["acceptance_by_depth"]) == {d for d in QUICK_DEPTHS
                                                    if d < model.config.depth}
    assert auto.tokens == generate(model, prompt, max_new_tokens=20).tokens
    with pytest.raises(GenerationError, match="calibration profile"):
        generate(model, prompt, schedule="auto", max_new_tokens=4)


def test_the_prompt_s_acceptance_is_an_estimate_not_a_certainty():
    """Eight positions that all agree with depth R say 0.9, not 1.0: a few agreeing positions
    must not send the search to its longest drafts; agreement over many positions is kept."""
    import torch

    from wfd.generate import prompt_acceptance

    final = torch.arange(8)
    short = prompt_acceptance({1: final.clone(), 2: torch.zeros(8, dtype=torch.long), 4: final},
                              4)
    assert short == {1: 0.9, 2: 0.2}  # (8 + 1) / 10; (1 agreeing: position 0, + 1) / 10
    long = torch.arange(1000)
    assert prompt_acceptance({3: long.clone(), 8: long}, 8)[3] == pytest.approx(0.999, abs=1e-3)


def test_this_machines_profile_is_found_or_the_error_says_how_to_make_one(monkeypatch,
                                                                            tmp_path):
    import shutil

    import costmodel.store as store
    from wfd.transplant import profile_for

    monkeypatch.setattr(store, "PROFILES_DIR", tmp_path)
    monkeypatch.setenv("LOOPED_DECODING_CACHE", str(tmp_path / "cache"))
    huginn, ouro = tiny_model("huginn"), tiny_model("ouro")
    with pytest.raises(GenerationError, match="costmodel calibrate --model huginn"):
        profile_for(huginn, "tiny", "cpu")  # nothing of this device kind to start from
    shutil.copy(CPU_PROFILE, tmp_path / "cpu-huginn-fp32.json")
    here = load_profile(CPU_PROFILE).machine  # as if this were the profile's machine
    monkeypatch.setenv("LOOPED_DECODING_MACHINE", here)
    said = []
    path, profile = profile_for(huginn, "tiny", "cpu", say=said.append)
    assert Path(path).name == "cpu-huginn-fp32.json" and profile.device == "cpu"
    assert said == []  # this machine's own calibration: nothing timed, nothing said
    with pytest.raises(GenerationError, match="costmodel calibrate --model ouro"):
        profile_for(ouro, "tiny", "cpu")


def test_workload_fields_the_search_does_not_price_are_refused():
    # exits, a run of prompts and a single acceptance were ignored without a word
    for wl in (Workload(exit_depths={4: 0.5, 32: 0.5}), Workload(prompts=4, batch_size=2),
               Workload(acceptance=0.5)):
        with pytest.raises(ValueError, match="leave exits, a run of prompts"):
            recommend("huginn-3.5b", "h200", {4: 0.9}, wl)
    with pytest.raises(ValueError, match="at most R = 32 slots, got 40"):
        recommend("huginn-3.5b", "h200", {4: 0.9}, Workload(kv_sharing=40))
