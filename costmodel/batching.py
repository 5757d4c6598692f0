"""Many sequences in one batch, written once: which sequences' calls run together, and when a
waiting sequence takes a finished one's place. The decoder (``wfd.batch``) runs the merged calls
with tensors; the simulator (``costmodel.simulate.simulate_batch``) records and prices them.

Every sequence executes its own plan (``costmodel.plans``) with its own executor. Which point of
its schedule a sequence is at is its clock, (round, block calls so far in the round, part), the
parts ranked coda < prelude < block (a round ends with its readout; a new token enters before the
block call that advances it). A round is an AR token, a DtV round or a WFD tick; sequences of one
schedule share the rounds' shape, so running the smallest clock first keeps them in step: AR's R
block calls, DtV's drafting and verification and WFD's ticks each run as one call for the whole
batch. A prefill runs before any decoding (its own clock, merged with the prefills that start
with it; a newcomer waits for one under way, first come first served), and the sequence then
joins at the next round no one has begun.

When a sequence ends (its executor is ``done``), its region goes to the next waiting sequence
before the next call (continuous batching), so the batch stays full while sequences remain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from .plans import Call, Executor, Plan

PART_RANK = {"coda": 0, "prelude": 1, "block": 2}
PREFILL = -1  # the round of every prefill call: before any decoding round

Job = TypeVar("Job")


class Lane(Generic[Job]):
    """One sequence in the batch: its region (of the KV cache), executor, plan and clock."""

    def __init__(self, region: int, job: Job, executor: Executor, plan: Plan,
                 round_offset: int):
        self.region, self.job, self.executor, self.plan = region, job, executor, plan
        self.steps = plan.steps()
        self.round_offset = round_offset
        self.round, self.blocks_in_round, self.calls_in_round = PREFILL, 0, 0
        self.block_calls = 0  # the batch's block calls this sequence took part in
        self.pending: Call | None = None

    def advance(self) -> None:
        """Run the sequence's events up to its next call (None once it is done)."""
        self.pending = self.executor.advance(self.steps)
        round_ = PREFILL if self.plan.rounds == 0 else self.round_offset + self.plan.rounds
        if round_ != self.round:
            self.round, self.blocks_in_round, self.calls_in_round = round_, 0, 0

    @property
    def clock(self) -> tuple[int, int, int]:
        return self.round, self.blocks_in_round, PART_RANK[self.pending.kind]

    def ran(self) -> None:
        self.calls_in_round += 1
        if self.pending.kind == "block":
            self.blocks_in_round += 1
            self.block_calls += 1

    @property
    def next_fresh_round(self) -> int:
        """The first round this sequence has not begun."""
        return self.round + (self.calls_in_round > 0)


def merged_call(lanes: Sequence[Lane]) -> tuple[str, list[int], list[int], list[int]]:
    """(part, positions, depths, sequences) of the one call that serves ``lanes``' pending calls,
    sequence by sequence."""
    calls = [lane.pending for lane in lanes]
    return (calls[0].kind, [p for c in calls for p in c.positions],
            [r for c in calls for r in c.depths],
            [lane.region for lane, c in zip(lanes, calls, strict=True) for _ in c.positions])


def run_batch(jobs: Sequence[Job], regions: int,
              start: Callable[[Job, int], tuple[Executor, Plan]],
              run_call: Callable[[list[Lane]], None],
              finish: Callable[[Lane], None],
              admit: Callable[[Job, list[Lane]], bool] | None = None) -> None:
    """Run every job, ``regions`` at a time. ``start(job, region)`` gives a job's executor and
    plan; ``run_call(lanes)`` runs one call over their pending calls (all at the same clock:
    ``merged_call``); ``finish(lane)`` takes a finished sequence before its region is reused;
    ``admit(job, lanes)``, where given, says whether the next job in line may start now (a
    stream's request that has arrived, whose KV fits): it must admit one when no sequence runs
    (waiting for its arrival), or raise."""
    if regions < 1:  # nothing would ever start: the loop below would not end
        raise ValueError(f"a batch needs at least one region, got {regions}")
    waiting = list(jobs)
    free = list(range(regions))
    lanes: list[Lane] = []
    while waiting or lanes:
        # a prefill under way finishes first: a newcomer starting beside it would run its own
        # prefill's calls first (the smaller clock) and hold back the earlier one's first token
        while free and waiting and not any(
                lane.round == PREFILL and lane.calls_in_round for lane in lanes) and (
                admit is None or admit(waiting[0], lanes)):
            job, region = waiting.pop(0), free.pop(0)
            executor, plan = start(job, region)
            decoding = [lane.next_fresh_round for lane in lanes if lane.round != PREFILL]
            lane = Lane(region, job, executor, plan, max(decoding, default=1) - 1)
            lane.advance()
            if lane.pending is None:  # nothing to run (a plan that ended at once)
                finish(lane)
                free.append(region)
                continue
            lanes.append(lane)
        if not lanes:
            if waiting and free:  # the hook refused with nothing running: it never would admit
                raise RuntimeError("admit refused a job while no sequence runs")
            continue
        clock = min(lane.clock for lane in lanes)
        ready = [lane for lane in lanes if lane.clock == clock]
        run_call(ready)
        for lane in ready:
            lane.ran()
            lane.advance()
            if lane.pending is None:
                lanes.remove(lane)
                finish(lane)
                free.append(lane.region)
