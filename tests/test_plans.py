"""The bridge: the decoder and the simulator execute the same plans, so a decoder run's own
outcomes replayed through the simulator give back its call trace, call for call."""

import pytest
from conftest import model_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel import AR, WFD, DtV, get_hardware, simulate
from costmodel.plans import Bonus, Call, Rollback, Verify
from wfd.generate import generate

HARDWARE = get_hardware("a6000")
def shape(records):
    return [(r.kind, r.positions, r.depths, r.contexts, r.slots) for r in records]


def schedule_of(name: str, k: int, d: int, cap: int | None):
    return {"ar": AR(), "dtv": DtV(block_length=k, draft_depth=d),
            "wfd": WFD(draft_depth=d, width_cap=cap)}[name]


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["huginn", "ouro"]), st.booleans(), st.sampled_from(["ar", "dtv", "wfd"]),
       st.lists(st.integers(0, 63), min_size=1, max_size=8), st.integers(2, 16),
       st.integers(1, 6), st.integers(1, 7), st.one_of(st.none(), st.integers(1, 6)),
       st.sampled_from([0, 1, 2]))
def test_a_decoder_run_replays_call_for_call(family, easy, name, prompt, new_tokens, k, d, cap,
                                             sharing):
    model = model_for(family, easy)
    depth = model.config.depth
    d = min(d, depth - 1)
    run = generate(model, prompt, schedule=name, max_new_tokens=new_tokens, draft_depth=d,
                   block_length=k, width_cap=cap, kv_sharing=sharing)
    spec = model.config.to_spec("tiny")
    sim = simulate(spec, HARDWARE, schedule_of(name, k, d, cap), context_length=len(prompt),
                   new_tokens=new_tokens, accept_sequence=run.acceptance_sequence(),
                   depth=depth, kv_sharing=sharing, prefill=True)
    assert shape(sim.records) == shape(run.records)
    assert sim.committed_tokens == len(run.tokens) - 1
    if name != "ar":
        assert sim.accepted == run.stats["accepted"]
        assert sim.rejected == run.stats["corrections"]
        assert sim.flushed_positions == run.stats["flushed_positions"]


@pytest.mark.parametrize("family", ["huginn", "ouro"])
@pytest.mark.parametrize("schedule", [DtV(block_length=3, draft_depth=1),
                                      WFD(draft_depth=1), WFD(draft_depth=2, width_cap=2)])
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_forced_acceptance_draws_the_simulators_outcomes(family, schedule, mode):
    """A timing run with forced acceptance (alpha, seed) is the simulator's run with the same
    Bernoulli draws: one outcome per position, whatever the schedule; a static run's (graphs
    mode's calls) is the simulator's in graphs mode, each decode call reading its static span."""
    model = model_for(family, False)
    run = generate(model, [1, 2, 3, 4], schedule=schedule.kind, max_new_tokens=30,
                   draft_depth=schedule.draft_depth,
                   block_length=getattr(schedule, "block_length", 4),
                   width_cap=getattr(schedule, "width_cap", None), force_acceptance=0.7, seed=5,
                   mode=mode)
    hardware = HARDWARE.in_mode("graphs" if mode == "static" else "eager")
    sim = simulate(model.config.to_spec("tiny"), hardware, schedule, context_length=4,
                   new_tokens=30, acceptance=0.7, seed=5, depth=model.config.depth,
                   prefill=True)
    assert shape(sim.records) == shape(run.records)
    assert 0 < sim.rejected < sim.committed_tokens


def test_plans_say_what_dtv_and_wfd_do():
    """The events of one DtV round and of a WFD rejection, read off the plans."""
    dtv = DtV(draft_depth=1, block_length=2).plan(3, 4, coda_attends=False,
                                                  prefill=False).steps()
    events = [next(dtv) for _ in range(16)]  # 3 drafts (P, B, C, Draft), 3 B, C, Verify
    assert events[0] == Call("prelude", (3,), (0,))
    assert events[-3:] == [Call("block", (3, 4, 5), (4, 4, 4)), Call("coda", (3, 4, 5),
                                                                      (4, 4, 4)), Verify(3)]
    assert dtv.send(False) == Rollback(4)  # the correction of position 3's draft is committed
    wfd = WFD(draft_depth=2).plan(5, 4, coda_attends=False, prefill=False).steps()
    events = []
    while not events or not isinstance(events[-1], Verify):
        events.append(next(wfd))
    assert Call("block", (5, 6), (4, 2)) in events and events[-1] == Verify(5)
    assert wfd.send(False) == Rollback(6, flushed=1)
    assert next(wfd) == Call("prelude", (6,), (0,))
    ar = AR().plan(2, 3, coda_attends=True).steps()
    assert [next(ar) for _ in range(6)][-1] == Bonus(1)  # the prefill commits the first token
