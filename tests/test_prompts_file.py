"""`wfd generate --prompts-file` (wfd.prompts): a JSON Lines file of prompts decoded in a
batch, each line's result or error written in the file's order, a line's own new tokens and
sampling seed."""

import json
import subprocess
import sys

import pytest
from conftest import model_for

from wfd.batch import decode_batch
from wfd.generate import GenerationError, Sampling, generate

CLI = [sys.executable, "-m", "wfd"]


def test_prompts_file_cli(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt": "def f(x):"}),
        json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": 3}),
        "{not json",
        json.dumps({"prompt": "x", "max_new_tokens": -1}),
        "",
        json.dumps({"prompt": "import os", "max_new_tokens": 5}),
        json.dumps({"prompt": "too long", "max_new_tokens": 100_000}),  # it ended the run
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    res = subprocess.run([*CLI, "generate", "--model", "huginn-tiny", "--prompts-file",
                          str(prompts), "--batch-size", "2", "--schedule", "wfd",
                          "--max-new-tokens", "6", "--out", str(out), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr  # three bad lines, the others served
    assert "line 3: not JSON" in res.stderr and "line 4: max_new_tokens" in res.stderr
    assert "line 7: a prompt of 8 tokens plus 100000 new ones exceeds" in res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 6, 7]
    assert [r.get("new_tokens") for r in rows] == [6, 3, None, None, 5, None]
    assert "error" in rows[2] and "error" in rows[3] and "error" in rows[5]
    totals = json.loads(res.stdout)
    assert totals["served"] == 3 and totals["skipped"] == 3 and totals["batch_size"] == 2
    from wfd.checkpoint import load_model

    shipped = load_model("huginn-tiny")
    alone = generate(shipped, list(b"def f(x):"), max_new_tokens=6, record=False)
    assert rows[0]["tokens"] == alone.tokens


@pytest.mark.parametrize("args", [
    ["--prompts-file", "missing.jsonl"],
    ["--prompts-file", "{p}", "--prompt", "x"],
    ["--prompts-file", "{p}", "--batch-size", "0"],
    ["--prompts-file", "{p}", "--schedule", "auto"],
    ["--prompts-file", "{p}", "--json"],
    ["--prompt", "x", "--batch-size", "4"],
    ["--prompts-file", "{p}", "--out", "{p}"],  # it overwrote the prompts with the results
    # refused inside the run, under its progress bar (which left a blank line first)
    ["--prompts-file", "{p}", "--kv-sharing", "99"],
])
def test_prompts_file_bad_input_is_one_line(args, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hi"}) + "\n")
    res = subprocess.run([*CLI, "generate", "--model", "huginn-tiny",
                          *[a.format(p=p) for a in args]],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert p.read_text() == json.dumps({"prompt": "hi"}) + "\n"


def test_an_unreadable_prompts_file_says_why_in_words(tmp_path):
    # it printed OSError's "[Errno 2] No such file or directory: '/path'" after the path (the
    # command line's one line and exit 2: test_prompts_file_bad_input_is_one_line)
    from wfd.prompts import read_prompts

    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    config = model_for("huginn", True).config
    for path, said in ((binary, "is not text"), (tmp_path / "gone.jsonl", "No such file")):
        with pytest.raises(ValueError, match=said) as caught:
            read_prompts(path, None, config, 4)
        assert "Errno" not in str(caught.value) and str(path) in str(caught.value)


def test_a_prompts_file_line_may_carry_its_own_sampling_seed(tmp_path):
    """The same prompt on two lines with seeds of their own: each its batch-1 run with its
    seed; a seed out of range is its line's error."""
    from wfd.prompts import read_prompts

    model = model_for("huginn", True)
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (
        {"prompt_ids": [1, 2, 3], "seed": 1}, {"prompt_ids": [1, 2, 3], "seed": 2},
        {"prompt_ids": [1, 2, 3], "seed": -1}, {"prompt_ids": [1, 2, 3], "seed": 2 ** 32},
        {"prompt_ids": [1, 2, 3], "seed": "7"})) + "\n")
    lines = read_prompts(path, None, model.config, 8)
    assert [line.error for line in lines[2:]] == [
        f"line {n}: seed must be an integer in 0..{2 ** 32 - 1}, got {bad!r}"
        for n, bad in ((3, -1), (4, 2 ** 32), (5, "7"))]
    sampling = Sampling(temperature=1.0, seed=0)
    run = decode_batch(model, [line.request for line in lines[:2]], schedule="wfd",
                       batch_size=2, sampling=sampling)
    tokens = {r.index: r.tokens for r in run.results}
    for index, seed in ((0, 1), (1, 2)):
        assert tokens[index] == generate(model, [1, 2, 3], schedule="wfd", max_new_tokens=8,
                                         sampling=Sampling(1.0, seed=seed)).tokens
    assert tokens[0] != tokens[1]
    with pytest.raises(GenerationError, match="seed must be in 0..4294967295"):
        Sampling(1.0, seed=2 ** 40)
    with pytest.raises(GenerationError, match="seed"):
        generate(model, [1, 2, 3], max_new_tokens=2, seed=-1)
