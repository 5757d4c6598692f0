"""Choose a schedule: every AR, DtV(k, d) and WFD(d, cap) configuration priced by the closed
forms with the acceptance measured at its own draft depth, the finalists re-priced call by call
by the simulator, ranked by predicted tokens/s.

The acceptance at each draft depth comes from a depth trace (the agreement of every depth's
readout with the full-depth one, recorded once by an AR run) or is given depth by depth. The
search is exhaustive: d over the depths given, k in 1..32, every width cap below the wave's
natural width.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from .cost import TERMS
from .hardware import HardwareSpec
from .memory import DoesNotFit, does_not_fit, memory_report
from .model import LoopedModelSpec
from .predict import _bound, _Pricer, decode_keys
from .presets import resolve
from .schedules import AR, SCHEDULES, Schedule, get, widest
from .simulate import simulate
from .slots import check_kv_sharing
from .workload import Workload

FINALISTS = 5  # configurations re-priced by the simulator
QUICK_FINALISTS = 2
SIMULATED_TOKENS = 160
QUICK_SIMULATED_TOKENS = 64
CAP_RANGE = 1.5


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    schedule: str  # its name in the registry (costmodel.schedules)
    draft_depth: int | None = None
    block_length: int | None = None
    width_cap: int | None = None
    width: int | None = None
    acceptance: float | None = None
    latency_per_token_s: float
    tokens_per_s: float
    speedup_vs_ar: float = 1.0
    bound: Literal["bandwidth", "compute", "overhead"]

    @property
    def label(self) -> str:
        return get(self.schedule).label(self.draft_depth, self.block_length, self.width,
                                        self.width_cap)

    @property
    def flags(self) -> str:
        """The `wfd generate` options that run this configuration."""
        return self.schedule_spec().flags()

    def schedule_spec(self) -> Schedule:
        return get(self.schedule).of(self.draft_depth, self.block_length, self.width_cap)


def parse_acceptance_by_depth(text: str) -> dict[int, float]:
    """'1:0.6,2:0.8' -> {1: 0.6, 2: 0.8}."""
    out: dict[int, float] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        depth, sep, value = item.partition(":")
        try:
            d, alpha = int(depth), float(value)
        except ValueError:
            raise ValueError(f"acceptance by depth takes DEPTH:ACCEPTANCE pairs such as "
                             f"1:0.6,4:0.9; got {item!r}") from None
        if not sep:
            raise ValueError(f"acceptance by depth: {item!r} has no ':'")
        if d in out:
            raise ValueError(f"acceptance by depth gives depth {d} twice")
        out[d] = alpha
    return out


def check_acceptance(acceptance: dict[int, float], depth: int) -> None:
    if not isinstance(acceptance, dict):
        raise TypeError(f"acceptance is by draft depth, e.g. {{4: 0.9}}, got {acceptance!r}")
    if not acceptance:
        raise ValueError("no acceptance at any draft depth (an empty trace?)")
    for d, alpha in acceptance.items():
        if not 1 <= d < depth:
            raise ValueError(f"draft depth {d} outside 1..{depth - 1} (R = {depth})")
        if not 0 <= alpha <= 1:
            raise ValueError(f"acceptance {alpha} at depth {d} outside [0, 1]")


# The quick search (``wfd generate --schedule auto``, which must cost little beside the run it
# chooses for) tries these draft depths only (and each schedule's quick variants: DtV's
# QUICK_BLOCK_LENGTHS), and no width cap (a capped
# wave's closed form is the costliest to build, and a cap rarely pays: docs/recommend.md).
QUICK_DEPTHS = (1, 2, 3, 4, 8, 16)


def _check_search(spec: LoopedModelSpec, hw: HardwareSpec, wl: Workload, depth: int,
                  acceptance: dict[int, float]) -> None:
    """Refuse a search ``recommend`` cannot make, or a workload that does not fit, in one
    line."""
    if wl.adaptive or wl.prompts is not None or wl.acceptance is not None or wl.depth_trace:
        # each was ignored: the search prices fixed-depth steady states at ``acceptance``
        raise ValueError("recommend prices a full batch at fixed depth from its acceptance by "
                         "depth: leave exits, a run of prompts and a single acceptance or depth "
                         "trace out of the workload")
    check_kv_sharing(wl.kv_sharing, depth)
    check_acceptance(acceptance, depth)
    hw.achievable_flops_per_s(wl.dtype)  # an unknown dtype fails here with a clear message
    # what predict allocates for every schedule's widest variant: the same verdict
    positions, ahead = widest(depth)
    memory = memory_report(spec, hw, wl, depth=depth, readout_depths=2,
                           positions_per_call=positions, lookahead=ahead)
    if not memory.fits:
        raise DoesNotFit(f"on {hw.name}: {does_not_fit(memory, wl)}")


def recommend(model: str | LoopedModelSpec, hardware: str | HardwareSpec,
              acceptance: dict[int, float], workload: Workload | dict | None = None, *,
              top: int = 5, seed: int = 0, quick: bool = False) -> list[Choice]:
    """The ``top`` configurations by predicted tokens/s, best first; speedups are over AR's
    predicted latency for the same workload. The search tries every draft depth given, every
    block length in 1..32 and every width cap, then re-prices the finalists with the simulator;
    ``quick`` tries QUICK_DEPTHS and DtV's QUICK_BLOCK_LENGTHS and no cap, and simulates the best
    QUICK_FINALISTS only."""
    spec, hw = resolve(model, hardware)
    wl = Workload.model_validate(workload or {})  # a Workload, or its fields as a dict
    depth = wl.depth or spec.default_depth
    _check_search(spec, hw, wl, depth, acceptance)
    pricer = _Pricer(spec, hw, wl.dtype, np.asarray(decode_keys(wl, hw)),
                     np.asarray(float(wl.batch_size)), None)

    def priced(schedule: Schedule, alpha: float | None) -> Choice:
        totals = pricer.per_token(schedule.call_groups(depth, wl.kv_sharing),
                                  np.asarray(alpha or 0.0))
        latency = float(totals["latency_s"])
        fields = {"width_cap": None, **schedule.fields(depth)}
        return Choice(schedule=schedule.name, **fields, acceptance=alpha,
                      latency_per_token_s=latency, tokens_per_s=wl.batch_size / latency,
                      bound=_bound({k: float(totals[k]) for k in TERMS}))

    # the baseline once; each schedule that drafts at every draft depth given, at its acceptance
    candidates = [ar := priced(AR(), None)]
    for d, alpha in sorted(acceptance.items()):
        if quick and d not in QUICK_DEPTHS:
            continue
        candidates += [priced(s, alpha) for cls in SCHEDULES.values() if cls.drafts
                       for s in cls.variants(d, depth, quick=quick)]
    # refinements (WFD's width caps): for the configurations within CAP_RANGE of the best of
    # their schedule (a cap trades wider calls for more of them: it moves a wave's cost by far
    # less than that)
    if not quick:
        for name in SCHEDULES:
            own = [c for c in candidates if c.schedule == name]
            best = min((c.latency_per_token_s for c in own), default=0.0)
            candidates += [priced(s, c.acceptance) for c in own
                           if c.latency_per_token_s <= CAP_RANGE * best
                           for s in c.schedule_spec().refinements(depth)]
    candidates.sort(key=lambda c: c.latency_per_token_s)
    finalists = candidates[:max(QUICK_FINALISTS if quick else FINALISTS, top)]
    finalists += [] if ar in finalists else [ar]
    # the simulator prices each call at its own context, and the wave's fill and the last
    # round, which the closed forms leave out, over a stretch of the generation centred on its
    # mean context (hundreds of candidates must answer in about a second)
    new_tokens = max(2, min(wl.new_tokens, QUICK_SIMULATED_TOKENS if quick else SIMULATED_TOKENS))
    context = wl.context_length + (wl.new_tokens - new_tokens) // 2
    for choice in finalists:
        if choice is not ar or not quick:
            sim = simulate(spec, hw, choice.schedule_spec(), context_length=context,
                           new_tokens=new_tokens, acceptance=choice.acceptance or 0.0,
                           seed=seed, depth=depth, kv_sharing=wl.kv_sharing, dtype=wl.dtype,
                           batch_size=wl.batch_size, records=False)
            choice.latency_per_token_s = sim.latency_per_token_s
            choice.tokens_per_s = wl.batch_size / sim.latency_per_token_s
    for choice in finalists:
        choice.speedup_vs_ar = ar.latency_per_token_s / choice.latency_per_token_s
    return sorted(finalists, key=lambda c: c.latency_per_token_s)[:top]
