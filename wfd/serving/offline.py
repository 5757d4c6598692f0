"""Generation on vLLM from token ids, one engine per call, in a process of its own:
what the tests and the bench compare with ``wfd``'s decoder. vLLM's engine starts worker
processes, so it runs here under ``__main__``:

    python -m wfd.serving.offline JOB.json OUT.json   # writes {"engine_s": ..., "runs": [...]}
    python -m wfd.serving.offline --jobs   # lines "JOB.json OUT.json" on standard input

With ``--jobs`` the jobs run one after another in this process, each engine shut down before
the next starts (vLLM imported once: a job then costs its engine's start, 1-2 s for a tiny
model, not the 8-10 s of a process of its own); each line is answered on standard output by
``wfd.serving.offline: done OUT.json`` once OUT is written. Its engine cores run in this
process (a job of several ranks starts its workers in processes of their own, as vLLM does). A
job that fails ends the process (its one line on standard error, exit 2).

JOB: {"model": folder, "overrides": {...} (hf_overrides: recurrence_depth, kv_sharing,
draft_depth, ...), "speculative_tokens": k (DtV: the same checkpoint drafts k tokens at its
draft depth, vLLM's draft_model method; the output adds vLLM's counters), "kv_blocks": N (the
KV cache held to N blocks: preemption; the output adds vLLM's counters), "block_tokens": B
(vLLM's KV block, a multiple of 32 on its CPU build; null: its default),
"speculative_options": {...} (more of vLLM's speculative_config, e.g. draft_sample_method),
overrides {"schedule": "wfd" or "dtv", "draft_depth": d} (the plugin's own WFD or DtV in the
engine: each run adds the wave's counters, and the output vLLM's counters: the tokens the waves
committed ahead are its speculative ones),
"dtype": "float32", "eager": true (false: vLLM's torch.compile), "in_process": false (true: the
engine core in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0), "tensor_parallel": 1,
"max_model_len": null (the model's), "runs": [{"prompts": [[ids], ...], "max_tokens": N,
"batch": B, "temperature": 0 (greedy), "top_p": 1, "seed": S (sampling: prompt i seeded S + i;
null: unseeded), "allowed_token_ids": [ids] (all), "commit_ahead": k (the plugin's WFD and DtV:
each request's own bound on tokens its wave commits ahead; null: the engine's, for plain greedy
requests), "exit": "RULE[:THRESHOLD]" or "none" and "exit_min_depth": M (each request's own
exit rule, on an engine started with the exit_rule override; null: the engine's)}, ...]}.
Each run sends its prompts B at a time (B = 1: one request at a time) and reports each
prompt's new tokens and the run's seconds. With the engine core in-process the
output also gives the KV cache vLLM made: its bytes, its tokens and its block's tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run_job(job: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny models need little
    if job.get("in_process"):  # no engine-core process: starts in seconds, not tens
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    overrides = job.get("overrides") or {}
    wave = overrides.get("schedule") in ("dtv", "wfd") or overrides.get("exit_rule") is not None
    if wave:  # the wave's counters are read by a function sent to the engine
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    ranks = job.get("tensor_parallel", 1)
    if ranks > 1:  # vLLM's CPU build binds each rank's threads to a NUMA node, or to these cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(ranks))))
    from vllm import LLM

    k = job.get("speculative_tokens")
    speculative = {"method": "draft_model", "model": job["model"], "num_speculative_tokens": k,
                   **job.get("speculative_options", {})} if k else None
    counted = speculative or job.get("kv_blocks") or wave  # the output gives vLLM's counters
    started = time.perf_counter()
    settle_heap()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
              enforce_eager=job.get("eager", True),
              skip_tokenizer_init=True, max_model_len=job.get("max_model_len"),
              max_num_seqs=max(run.get("batch", 1) for run in job["runs"]), seed=0,
              tensor_parallel_size=ranks,
              hf_overrides=job.get("overrides") or None, speculative_config=speculative,
              num_gpu_blocks_override=job.get("kv_blocks"),
              block_size=job.get("block_tokens"),
              disable_log_stats=not counted)
    engine_s = time.perf_counter() - started
    cache = llm.llm_engine.vllm_config.cache_config  # filled in where the engine core ran
    kv = {"kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
          "kv_cache_bytes": cache.kv_cache_memory_bytes, "kv_block_tokens": cache.block_size} \
        if cache.num_gpu_blocks else {}
    try:
        results = [decode_run(llm, run, wave) for run in job["runs"]]
        return {"engine_s": engine_s, **kv, "runs": results,
                **({"counters": engine_counters(llm)} if counted else {})}
    finally:  # a refused request too: the engine's processes end with it
        shut_down(llm)


def decode_run(llm, run: dict, wave: bool) -> dict:
    """One run of a job on the engine: its prompts in batches, their tokens and seconds (and
    the waves' counters after it)."""
    from vllm import SamplingParams

    temperature, seed = run.get("temperature", 0.0), run.get("seed")
    extra = {key: run[key] for key in ("commit_ahead", "exit", "exit_min_depth")
             if run.get(key) is not None}
    params = [SamplingParams(temperature=temperature, top_p=run.get("top_p", 1.0),
                             seed=seed + i if temperature and seed is not None else None,
                             max_tokens=run["max_tokens"], detokenize=False, ignore_eos=True,
                             allowed_token_ids=run.get("allowed_token_ids"),
                             extra_args=extra or None)
              for i in range(len(run["prompts"]))]
    prompts, batch, tokens = run["prompts"], run.get("batch", 1), []
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]],
                               params[i:i + batch], use_tqdm=False)
        tokens += [list(out.outputs[0].token_ids) for out in outputs]
    return {"tokens": tokens, "seconds": time.perf_counter() - started,
            **({"wave": wave_counters(llm)} if wave else {})}


def shut_down(llm) -> None:
    """The engine stopped (vLLM's own clean-up: its process groups gone), so that another can
    start in this process; its memory (weights, KV cache) is given back once the caller lets go
    of it, by the next collection (``settle_heap``, before the next engine)."""
    llm.llm_engine.engine_core.shutdown()


def settle_heap() -> None:
    """Before an engine starts in this process: the engines before it collected (their memory
    given back), and what is left, mostly the modules vLLM and torch import, frozen out of later
    collections. vLLM collects the whole heap several times as it loads and stops a model, each
    time walking those modules' objects again (about 0.4 s a walk on this project's 2-core VM);
    frozen, they are skipped until vLLM's clean-up unfreezes them as the engine stops."""
    import gc

    gc.collect()
    gc.freeze()


def wave_counters(llm) -> dict[str, int]:
    """WFD in the engine: drafts verified and accepted, positions flushed and block calls, over
    the engine's life so far (wfd.serving.wave)."""
    from wfd.serving.wave import counters  # by its module's name: sent to the engine's process

    return llm.apply_model(counters)[0]


def engine_counters(llm) -> dict[str, int]:
    """vLLM's counters of speculative decoding (drafts, draft tokens, accepted tokens) and of
    preempted requests, as its /metrics endpoint exports them."""
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
             "vllm:num_preemptions": "preemptions"}
    return {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}


def run_apart(job: dict, env: dict | None = None, cwd: str | Path | None = None,
              timeout: float | None = None) -> dict:
    """``job``'s output from ``python -m wfd.serving.offline`` in a process of its own (an
    engine that leaves nothing behind in the caller's); a failed run exits the caller (a bench)
    with the tail of its log."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(job))
        done = subprocess.run([sys.executable, "-m", "wfd.serving.offline", str(spec), str(out)],
                              capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout)
        if done.returncode:
            sys.exit(f"error: vLLM's run failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def run_file(job: str, out: str) -> None:
    Path(out).write_text(json.dumps(run_job(json.loads(Path(job).read_text()))))


def run_jobs(lines) -> None:
    """``--jobs``: each line's job in this process, its engine core in-process."""
    for line in lines:
        if not line.strip():
            continue
        job, out = line.split()
        spec = json.loads(Path(job).read_text())
        Path(out).write_text(json.dumps(run_job({**spec, "in_process": True})))
        print(f"wfd.serving.offline: done {out}", flush=True)


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.exceptions import VLLMValidationError

    try:
        if sys.argv[1:] == ["--jobs"]:
            run_jobs(sys.stdin)
        else:
            run_file(*sys.argv[1:3])
    except VLLMValidationError as exc:  # a request vLLM refused (a server's 400): bad input
        raise ValueError(f"a request was refused: {exc}") from None


if __name__ == "__main__":  # a setting the plugin refuses (vLLM raises it while making its
    from costmodel.clitools import script_main  # config) as one line and exit code 2

    script_main(main)
