"""A test worker's engine process (``serving_jobs.Engines``): vLLM imported once, then each line
on standard input run here, one after another, and answered on standard output by
``engine_process: done OUT`` once OUT is written. A line is JSON, either
``{"job": JOB.json, "out": OUT}``, a job of ``wfd.serving.offline`` (its engine core in this
process; a job of two ranks starts their worker processes), or ``{"call": "module:function",
"args": [...], "out": OUT}``, the function's result as JSON (a scenario that drives vLLM's
engine itself, or a table counted in its forward). A line that fails ends the process, its
traceback on standard error. vLLM starts its workers under this ``__main__`` guard."""

import importlib
import json
import os
import sys
from pathlib import Path


def answer(line: dict):
    from wfd.serving.offline import run_job

    if "job" in line:
        return run_job({**json.loads(Path(line["job"]).read_text()), "in_process": True})
    module, function = line["call"].split(":")
    return getattr(importlib.import_module(module), function)(*line.get("args", []))


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for text in sys.stdin:
        if text.strip():
            line = json.loads(text)
            Path(line["out"]).write_text(json.dumps(answer(line)))
            print(f"engine_process: done {line['out']}", flush=True)


if __name__ == "__main__":
    main()
