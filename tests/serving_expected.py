"""What ``wfd`` decodes for the prompts the vLLM plugin's tests send (tests/test_serving.py):
the tokens, exit depths and draft counts the engine's runs must equal."""

from costmodel.exits import ExitRule
from wfd.batch import Request, SequenceResult, decode_batch
from wfd.generate import generate

NEW_TOKENS = 20  # a run's new tokens, unless it says


def wfd_runs(model, prompts, max_new_tokens: int = NEW_TOKENS, schedule: str = "ar",
             **options) -> list[SequenceResult]:
    """wfd's decode of each prompt (in their order), the prompts decoded together by its batch
    path: each sequence's tokens, exit depths, drafts verified and accepted and block calls are
    its own run's (tests/test_batch.py, tests/test_exits.py), in a fourth of the time of one
    prompt after another."""
    requests = [Request(i, p, max_new_tokens) for i, p in enumerate(prompts)]
    run = decode_batch(model, requests, schedule=schedule, batch_size=len(prompts), **options)
    return sorted(run.results, key=lambda result: result.index)


def ar_tokens(model, prompts, max_new_tokens: int = NEW_TOKENS, **options) -> list[list[int]]:
    return [result.tokens for result in wfd_runs(model, prompts, max_new_tokens, **options)]


def ar_with_exits(model, prompts, new: int, rule: str) -> list[tuple[list[int], list[int]]]:
    """wfd's AR with the exit ``rule`` (forced:DEPTHS: forced exits): each prompt's tokens
    and the depths they exited at."""
    if rule.startswith("forced:"):  # each prompt's drawn with the run's seed, as vLLM's
        # requests draw theirs (a batch draws with the seed + the prompt's index)
        runs = [generate(model, p, max_new_tokens=new, force_exits=rule.split(":", 1)[1])
                for p in prompts]
        return [(r.tokens, r.stats["exit_depths"]) for r in runs]
    return [(r.tokens, r.exit_depths)
            for r in wfd_runs(model, prompts, new, exit_rule=ExitRule.parse(rule))]
