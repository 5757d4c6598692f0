"""What the vLLM plugin's tests run engines with: a test worker's process of one-rank jobs
(``wfd.serving.offline --jobs``), and a job's output from it, or from a process of its own for
two ranks."""

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
    """This test worker's ``wfd.serving.offline --jobs`` process: the one-rank jobs run in it
    one after another, vLLM imported once (a job then costs its engine's start, not a process's
    8-10 s); started at the first job, and again after one that failed (which ends it)."""

    def __init__(self, log: Path):
        self.log, self.process = log, None

    def run(self, job: Path, out: Path, timeout: float = 600) -> None:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "wfd.serving.offline", "--jobs"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=open(self.log, "w"), env=UNBOUND)
        self.process.stdin.write(f"{job} {out}\n".encode())
        self.process.stdin.flush()
        done, seen = f"wfd.serving.offline: done {out}".encode(), b""
        deadline = time.monotonic() + timeout
        while done not in seen:  # vLLM logs to the same standard output: read to the answer
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                self.close()
                pytest.fail(f"no answer to {job} in {timeout} s")
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                self.process.wait()
                pytest.fail(f"{job} failed:\n{self.log.read_text()[-3000:]}")
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
    """wfd.serving.offline's output for this job, from an engine of its own (``kv_blocks``: its
    KV cache held to that many blocks of ``block_tokens``, its sequences to 256 tokens, or to
    ``max_model_len``): one rank in this worker's engine process, two in a process of their
    own (the engine core in it, each rank in a worker process)."""
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": str(model), "runs": runs, "overrides": overrides,
                               "tensor_parallel": tensor_parallel,
                               "speculative_tokens": speculative_tokens,
                               "kv_blocks": kv_blocks, "block_tokens": block_tokens,
                               "max_model_len": max_model_len or (256 if kv_blocks else None),
                               # one process fewer to start (seconds)
                               "in_process": tensor_parallel > 1}))
    if tensor_parallel == 1:
        engines.run(job, out)
    else:
        done = subprocess.run([sys.executable, "-m", "wfd.serving.offline", str(job),
                               str(out)], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path, env=UNBOUND)
        assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def vllm_tokens(engines: Engines, tmp_path: Path, model: Path, runs: list[dict], **options
                ) -> list[list[list[int]]]:
    """Each run's new tokens per prompt."""
    return [run["tokens"] for run in vllm_job(engines, tmp_path, model, runs, **options)["runs"]]
