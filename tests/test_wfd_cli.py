"""`wfd generate` as a user runs it."""

import json
import subprocess
import sys

import pytest
from conftest import run_cli

from costmodel.store import PROFILES_DIR

WFD = [sys.executable, "-m", "wfd"]


def run(*args):
    return subprocess.run([*WFD, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model", ["huginn-tiny:random", "ouro-tiny:random"])
def test_generate_json_and_traces(model, tmp_path):
    trace, depths = tmp_path / "calls.jsonl", tmp_path / "depths.jsonl"
    out = run("generate", "--model", model, "--prompt", "def f(x):", "--max-new-tokens", "6",
              "--trace", str(trace), "--depth-trace", str(depths), "--mode", "static", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["mode"] == "static" and payload["shapes_captured"] > 0
    assert payload["kv_bytes_allocated"] > 0 and payload["time_to_first_token_s"] > 0
    assert payload["new_tokens"] == len(payload["tokens"]) == 6
    assert payload["schedule"] == "ar" and payload["acceptance"] is None
    assert isinstance(payload["text"], str) and payload["tokens_per_s"] > 0
    from costmodel.trace import read_call_trace, read_depth_trace

    header, records = read_call_trace(trace)
    assert header.source == "measured" and header.prompt_length == len("def f(x):")
    # the attention kernel each call kind ran, in the output and the trace's header
    assert header.extra["attention_backend"] == payload["attention_backend"]
    assert set(payload["attention_backend"]) == {"prelude", "block", "coda"}
    assert payload["attention_backend"]["block"] not in ("none", "unknown")
    assert payload["captures_made"] == payload["shapes_captured"]  # a fresh process
    assert sum(r.kind == "block" for r in records) == payload["block_calls"]
    dt = read_depth_trace(depths)
    assert [r.token for r in dt.records] == payload["tokens"]


def test_prompt_ids_without_tokenizer_prints_ids():
    out = run("generate", "--model", "huginn-tiny:random", "--prompt-ids", "1,2,3",
              "--max-new-tokens", "3", "--depth", "4", "--init-scale", "0")
    assert out.returncode == 0, out.stderr
    assert "3 tokens" in out.stderr


@pytest.mark.parametrize("args", [
    ["--model", "no-such-model", "--prompt", "x"],
    ["--model", "huginn-tiny:random", "--prompt", "x" * 3000],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--depth", "0"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--dtype", "int4"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--device", "cuda"],
    ["--model", "huginn-tiny:random", "--prompt-ids", "1,a"],
    ["--model", "huginn-tiny:random", "--prompt-ids", "999"],
    ["--model", "huginn-tiny:random"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--schedule", "beam"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--temperature", "-1"],
    # (seed, position) seeds a 64-bit generator: it overflowed in torch's own words
    ["--model", "huginn-tiny:random", "--prompt", "x", "--seed", "10000000000000"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--mode", "fast"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--mode", "graphs"],  # no CUDA here
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "gate"],  # no gate
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "median"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl:0"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl:nan"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl", "--min-depth", "9"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl", "--min-depth", "0"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--min-depth", "2"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl", "--schedule", "auto"],
    ["--model", "huginn-tiny:random", "--prompt", "x", "--stop-ids", "-5"],  # never decoded
    # a depth trace under exits held short records that predict then indexed past
    ["--model", "huginn-tiny:random", "--prompt", "x", "--exit", "kl", "--depth-trace", "d.jsonl"],
])
def test_bad_input_is_one_line_and_exit_2(args, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a refused run might have written lands here
    code, _, err = run_cli(capsys, "generate", *args, program="wfd")
    assert code == 2, (args, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err


def test_auto_refuses_a_profile_of_another_device_or_dtype():
    # it read a GPU's bf16 profile for a CPU fp32 run: "has no peak flops for fp32"

    gpu = PROFILES_DIR / "gpu-huginn-bf16.json"
    out = run("generate", "--model", "huginn-tiny", "--prompt", "x", "--schedule", "auto",
              "--profile", str(gpu))
    assert out.returncode == 2 and "calibrated on cuda in bf16" in out.stderr, out.stderr


def test_a_folder_with_binary_or_unreadable_files_is_one_line(tmp_path):
    from conftest import tiny_model

    from wfd.checkpoint import save

    save(tiny_model("ouro"), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    for folder, message in (("ckpt", "is not a tokenizer file"), ("bad", "is not valid JSON")):
        out = run("generate", "--model", str(tmp_path / folder), "--prompt-ids", "5,6")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_checkpoint_folder_by_path(tmp_path):
    from conftest import tiny_model

    from wfd.checkpoint import save

    save(tiny_model("ouro"), tmp_path / "ckpt")
    out = run("generate", "--model", str(tmp_path / "ckpt"), "--prompt-ids", "5,6,7",
              "--max-new-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["text"] is None  # vocabulary of 64: no tokenizer


def test_a_byte_tokenizer_file_reads_text_as_its_utf8_bytes(tmp_path):
    """write_byte_tokenizer's file (for engines that read text through one) gives the tiny
    models' ids, bytes no printable character stands for included, and `wfd` reads it."""
    from wfd.tokenizer import ByteTokenizer, FileTokenizer, tokenizer_for, write_byte_tokenizer

    write_byte_tokenizer(tmp_path, max_length=2048)
    text = "def f(x):\n\treturn x  # é, €\x00\x7f"
    from_file = tokenizer_for(tmp_path, 256)
    assert isinstance(from_file, FileTokenizer)
    assert from_file.encode(text) == ByteTokenizer().encode(text)
    assert from_file.decode(list(range(256))) == ByteTokenizer().decode(list(range(256)))


def test_outputs_that_cannot_be_written_are_one_line_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a folder would have to be
    cases = [["wfd", "generate", "--prompt-ids", "5,6", "--trace", str(blocker / "t.jsonl")],
             ["costmodel", "calibrate", "--model", "huginn", "--out", str(blocker / "p.json")],
             ["costmodel", "study", "width", "--out", str(blocker / "studies")]]
    for command in cases:
        out = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True,
                             timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (command, out.stderr)
        assert str(blocker) in lines[0] and "Traceback" not in out.stderr
