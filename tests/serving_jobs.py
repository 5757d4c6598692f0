"""What the vLLM plugin's tests run engines with: a test worker's engine process
(``engine_process.py``), a job's output from it, and the scenarios it runs that drive vLLM's
engine step by step."""

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

# an engine with the suite's one thread per rank (conftest), not pinned: vLLM binds a thread to
# every core of the node (two ranks: one core each), which spins against the other test worker
UNBOUND = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class Engines:
    """This test worker's engine process (``engine_process.py``): the jobs run in it one after
    another, vLLM imported once (a job then costs its engine's start, not a process's 8-10 s);
    started at the first job, and again after one that failed (which ends it)."""

    def __init__(self, log: Path):
        self.log, self.process = log, None

    def run(self, job: Path, out: Path, timeout: float = 600) -> None:
        """A job of ``wfd.serving.offline``, its output written to ``out``."""
        self._ask(f"{job} {out}", f"wfd.serving.offline: done {out}", timeout)

    def call(self, function: str, *args, timeout: float = 600):
        """``function`` ("module:name", a module of wfd's or of the tests') called in the engine
        process with ``args``: its result, through JSON."""
        out = self.log.with_name(f"call-{function.replace(':', '-')}.json")
        self._ask(json.dumps({"call": function, "args": list(args), "out": str(out)}),
                  f"engine_process: done {out}", timeout)
        return json.loads(out.read_text())

    def _ask(self, line: str, answer: str, timeout: float) -> None:
        """``line`` sent to the engine process, and its output read until ``answer``."""
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("engine_process.py"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                env=UNBOUND)
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()
        done, seen = answer.encode(), b""
        deadline = time.monotonic() + timeout
        while done not in seen:  # vLLM logs to the same standard output: read to the answer
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                self.close()
                pytest.fail(f"no answer to {line} in {timeout} s")
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                self.process.wait()
                pytest.fail(f"{line} failed:\n{self.log.read_text()[-3000:]}")
            seen = seen[-len(done):] + chunk

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def vllm_job(engines: Engines, tmp_path: Path, model: Path, runs: list[dict],
             overrides: dict | None = None, tensor_parallel: int = 1,
             speculative_tokens: int | None = None, kv_blocks: int | None = None,
             block_tokens: int | None = None, max_model_len: int | None = None) -> dict:
    """wfd.serving.offline's output for this job, from an engine of its own in this worker's
    engine process (``kv_blocks``: its KV cache held to that many blocks of ``block_tokens``,
    its sequences to 256 tokens, or to ``max_model_len``; two ranks: each in a worker process
    of its own, the engine core in the engine process)."""
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": str(model), "runs": runs, "overrides": overrides,
                               "tensor_parallel": tensor_parallel,
                               "speculative_tokens": speculative_tokens,
                               "kv_blocks": kv_blocks, "block_tokens": block_tokens,
                               "max_model_len": max_model_len or (256 if kv_blocks else None)}))
    engines.run(job, out)
    return json.loads(out.read_text())


def vllm_tokens(engines: Engines, tmp_path: Path, model: Path, runs: list[dict], **options
                ) -> list[list[list[int]]]:
    """Each run's new tokens per prompt."""
    return [run["tokens"] for run in vllm_job(engines, tmp_path, model, runs, **options)["runs"]]


def abort_mid_wave(folder: str, prompts: list[list[int]], new_tokens: int
                   ) -> dict[str, list[int]]:
    """(Run in the engine process.) The plugin's WFD on vLLM's engine, stepped here: requests
    0-2 added, 1 aborted after two steps (mid-stream, its wave half built), and 3, with 1's
    prompt, added a step later; each finished request's tokens, by its id."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from wfd.serving.offline import settle_heap, shut_down

    settle_heap()
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_num_seqs=4, hf_overrides={"schedule": "wfd", "draft_depth": 2})
    engine, done, steps = llm.llm_engine, {}, 0
    params = SamplingParams(temperature=0, max_tokens=new_tokens, detokenize=False,
                            ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 2:
            engine.abort_request(["1"])
        if steps == 3:
            engine.add_request("3", {"prompt_token_ids": prompts[1]}, params)
    shut_down(llm)
    return done


def rule_joins_mid_stream(folder: str, prompts: list[list[int]], new_tokens: int
                          ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(Run in the engine process.) AR with exits per request (exit_rule "none"), stepped here:
    requests 0 and 1 without a rule (vLLM's forward decodes them), 2 with kl:0.01 and a third
    of their tokens added after three steps (0 and 1 go on in waves from their newest tokens,
    and hand back to vLLM's forward once 2 is done), 3 without a rule added once 0, 1 and 2
    are done (vLLM's forward again); each request's tokens by its id, and the waves'
    counters."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from wfd.serving.offline import settle_heap, shut_down
    from wfd.serving.wave import counters

    settle_heap()
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_num_seqs=4, hf_overrides={"exit_rule": "none"})
    engine, done, steps = llm.llm_engine, {}, 0

    def params(tokens=new_tokens, **extra):
        return SamplingParams(temperature=0, max_tokens=tokens, detokenize=False,
                              ignore_eos=True, extra_args=extra or None)

    for i in (0, 1):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params())
    while engine.has_unfinished_requests() or "3" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.add_request("2", {"prompt_token_ids": prompts[2]},
                               params(new_tokens // 3, exit="kl:0.01"))
        if len(done) == 3 and "3" not in done and not engine.has_unfinished_requests():
            engine.add_request("3", {"prompt_token_ids": prompts[3]}, params())
    totals = llm.apply_model(counters)[0]
    shut_down(llm)
    return done, totals
