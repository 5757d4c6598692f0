"""KV slots and keys: which slot of the cache a step writes and reads, and which keys a call
attends over. The plans, the decoder's cache and the vLLM plugin all place KV by these rules."""

from __future__ import annotations

from collections.abc import Sequence


def core_slot(depth: int, kv_sharing: int) -> int:
    """The KV slot written and read by the step that brings a position to ``depth`` (1-based):
    one slot per depth, or with s shared slots (depth - 1) mod s."""
    return (depth - 1) % kv_sharing if kv_sharing else depth - 1


def readout_depths(schedule, depth: int, exit_from: int | None = None) -> int:
    """The depths a sequence's tokens are read out at under ``schedule``, a coda KV slot each:
    R, d where the schedule drafts, and with exits every depth from ``exit_from`` (the
    shallowest a token may stop at) on."""
    reads = {depth} | ({schedule.draft_depth} if schedule.drafts else set())
    return len(reads | (set(range(exit_from, depth + 1)) if exit_from else set()))


def call_slots(kind: str, depths: Sequence[int], kv_sharing: int) -> list[int]:
    """The KV slot each position of a call reads and writes, as the call trace records it: 0 in
    the prelude, the core slot of its depth in the block, its readout depth in the coda."""
    if kind == "block":
        return [core_slot(r, kv_sharing) for r in depths]
    return [0] * len(depths) if kind == "prelude" else list(depths)


# A static call (graphs mode) attends over a fixed span of keys under a mask, rounded up to a
# multiple of this: a shape captured once serves every position of its bucket, at most this many
# keys are read past a position, and the captures grow with the context's length over the block,
# not with its tokens. The extra keys matter only where the KV is a large share of a call, that is
# at long contexts, where a fixed block is a small fraction of them (powers of two would read up
# to twice the keys there).
STATIC_SPAN_KEYS = 256


def static_span(keys: int) -> int:
    """The keys a static call reads when its latest position attends over ``keys``."""
    return -(-keys // STATIC_SPAN_KEYS) * STATIC_SPAN_KEYS


def keys_read(positions: Sequence[int], static: bool) -> list[int]:
    """The keys each position of a call attends over, as the call trace records them: its own
    prefix (p + 1) in eager mode; the call's static span in static and graphs modes."""
    if static:
        return [static_span(max(positions) + 1)] * len(positions)
    return [p + 1 for p in positions]


def in_prefill(positions: Sequence[int], prompt_length: int) -> bool:
    """Whether a call belongs to the prompt's prefill (decoding's calls hold a position past the
    prompt): a prefill call runs eagerly in every mode, so it reads its own prefix of keys."""
    return max(positions) < prompt_length


def mean_decode_keys(context, new_tokens, static: bool):
    """The keys a decode step attends over, on average over contexts L .. L + N - 1 (numbers or
    numpy arrays): L + (N - 1) / 2, or in static mode the mean of their static spans."""
    if not static:
        return context + (new_tokens - 1) / 2

    def spans_up_to(x):  # sum of static_span(c) for c = 1..x, in closed form
        q, r = x // STATIC_SPAN_KEYS, x % STATIC_SPAN_KEYS
        return STATIC_SPAN_KEYS * (STATIC_SPAN_KEYS * q * (q + 1) / 2 + r * (q + 1))

    return (spans_up_to(context + new_tokens - 1) - spans_up_to(context - 1)) / new_tokens


def check_kv_sharing(kv_sharing: int, depth: int) -> None:
    if not 0 <= kv_sharing <= depth:
        raise ValueError(f"KV sharing is 0 (a slot per depth) or at most R = {depth} slots, got "
                         f"{kv_sharing}")
