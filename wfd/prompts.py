"""Prompts files for batched decoding: one JSON object per line in, one per prompt out.

In: ``{"prompt": "text"}`` or ``{"prompt_ids": [1, 2, 3]}``, with an optional
``"max_new_tokens": N`` and ``"seed": S`` (its own sampling seed: the same prompt on several
lines, each with a seed, samples several continuations). Out, in the same order: the line
number, the tokens (and text where the model has a tokenizer), acceptance, block calls and wall
time, or the line's error. A bad line is reported with its number and the other prompts are
still served.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from .batch import Request, SequenceResult
from .options import SEEDS
from .runtime import check_length, check_prompt


@dataclass
class PromptLine:
    line: int  # 1-based line number in the file
    request: Request | None
    error: str | None = None


def read_prompts(path: Path, tokenizer, config, max_new_tokens: int) -> list[PromptLine]:
    """Every non-blank line of ``path`` as a request for a model of ``config`` (its vocabulary
    and context), or the reason it cannot be one."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the prompts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the prompts file {path} is not text (UTF-8)") from None
    lines: list[PromptLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        index = len(lines)
        try:
            request = _parse(raw, index, tokenizer, config, max_new_tokens)
        except ValueError as exc:
            lines.append(PromptLine(number, None, f"line {number}: {exc}"))
        else:
            lines.append(PromptLine(number, request))
    if not lines:
        raise ValueError(f"the prompts file {path} holds no prompts")
    return lines


def _parse(raw: str, index: int, tokenizer, config, max_new_tokens: int) -> Request:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected an object such as {\"prompt\": \"...\"}")
    unknown = set(obj) - {"prompt", "prompt_ids", "max_new_tokens", "seed"}
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r}; use prompt or prompt_ids, "
                         f"and max_new_tokens and seed")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise ValueError("give exactly one of prompt and prompt_ids")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError("prompt must be a string")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer.json; give prompt_ids")
        ids = tokenizer.encode(obj["prompt"])
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("prompt_ids must be a list of integers")
    check_prompt(ids, config.vocab_size)  # a GenerationError is a ValueError: the line's error
    new = obj.get("max_new_tokens", max_new_tokens)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {new!r}")
    check_length(len(ids), new, config.max_position_embeddings)  # one line, not the whole run
    seed = obj.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                             or not 0 <= seed < SEEDS):
        raise ValueError(f"seed must be an integer in 0..{SEEDS - 1}, got {seed!r}")
    return Request(index=index, prompt=list(ids), max_new_tokens=new, sampling_seed=seed)


def result_row(line: PromptLine, result: SequenceResult | None, tokenizer) -> dict:
    """The output object of one prompt."""
    if result is None:
        return {"line": line.line, "error": line.error}
    row = asdict(result)
    index = row.pop("index")
    row.pop("prompt")
    return {"line": line.line, "index": index, "prompt_length": len(result.prompt),
            "new_tokens": len(result.tokens),
            "text": tokenizer.decode(result.tokens) if tokenizer is not None else None, **row}


class OrderedWriter:
    """Writes each prompt's row as soon as it and every earlier prompt are done, so the output
    keeps the input order and a finished result is on disk at once; ``close`` writes what is
    left (out of order, each row naming its line, if a run stopped early)."""

    def __init__(self, lines: list[PromptLine], stream: IO[str], tokenizer):
        self.lines, self.stream, self.tokenizer = lines, stream, tokenizer
        self.done: dict[int, dict] = {i: result_row(line, None, tokenizer)
                                      for i, line in enumerate(lines) if line.request is None}
        self.next = 0
        self._drain()

    def add(self, result: SequenceResult) -> None:
        self.done[result.index] = result_row(self.lines[result.index], result, self.tokenizer)
        self._drain()

    def _drain(self) -> None:
        while self.next in self.done:
            self.stream.write(json.dumps(self.done.pop(self.next)) + "\n")
            self.next += 1
        self.stream.flush()

    def close(self) -> None:
        for index in sorted(self.done):
            self.stream.write(json.dumps(self.done.pop(index)) + "\n")
        self.stream.flush()
