"""A test worker's engine process (``serving_jobs.Engines``): vLLM imported once, then each line
on standard input run here, one after another. A line is either ``JOB.json OUT.json``, a job
of ``python -m wfd.serving.offline --jobs`` (its engine core in this process; a job of two
ranks starts their worker processes), answered as that answers it, or JSON, ``{"call":
"module:function", "args": [...], "out": OUT}``, the function's result written to OUT as JSON
(a scenario that drives vLLM's engine itself, or a table counted in its forward) and answered
by ``engine_process: done OUT``. A line that fails ends the process, its traceback on standard
error. vLLM starts its workers under this ``__main__`` guard."""

import importlib
import json
import os
import sys
from pathlib import Path


def call(line: dict) -> None:
    module, function = line["call"].split(":")
    result = getattr(importlib.import_module(module), function)(*line.get("args", []))
    Path(line["out"]).write_text(json.dumps(result))
    print(f"engine_process: done {line['out']}", flush=True)


def main() -> None:
    from wfd.serving.offline import run_jobs

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for text in sys.stdin:
        if text.lstrip().startswith("{"):
            call(json.loads(text))
        else:
            run_jobs([text])


if __name__ == "__main__":
    main()
