"""Fit the cost model's coefficients to measured calls (docs/calibration.md, step 5).

The fitted quantity is ``costmodel.cost.call_cost`` itself, with its few free coefficients (host
overheads, achievable fractions of the measured peaks, a CPU's product-curve scale): robust least
squares (soft-L1) on log times, so every call weighs by its relative error, with standard errors
from the Jacobian. A coefficient the calls do not determine is taken out, the least missed
first, and the rest fitted again (``FitResult.dropped`` says why). Observations from both of a
GPU's modes share the device's coefficients; each mode frees only its own host terms
(``MODE_TERMS``), so what one mode hides, the other determines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from costmodel.cost import call_cost
from costmodel.hardware import HardwareSpec
from costmodel.model import LoopedModelSpec
from costmodel.profile import FittedValue, HeldValue
from costmodel.trace import CallRecord

F_SCALE = 0.05


class Parameter(NamedTuple):
    """A coefficient a fit may free: its HardwareSpec field, bounds, start (and prior), unit, and
    kind: an "overhead" that the calls do not determine is dropped (0); a "fraction" or "scale"
    is held at its prior."""

    name: str
    lower: float
    upper: float
    start: float
    unit: str
    kind: str

    @property
    def held(self) -> float:
        """The value it is held at when taken out of a fit."""
        return 0.0 if self.kind == "overhead" else self.start


PARAMETERS = [Parameter(*row) for row in [
    ("host_overhead_s", 0.0, 5e-3, 2e-5, "s", "overhead"),
    ("layer_overhead_s", 0.0, 5e-3, 1e-5, "s per layer", "overhead"),
    ("attention_one_set_host_s", 0.0, 5e-3, 5e-6, "s per layer", "overhead"),
    ("attention_grouped_host_s", 0.0, 5e-3, 5e-6, "s per layer", "overhead"),
    ("attention_key_set_s", 0.0, 1e-4, 1e-6, "s per key set and head, per layer", "overhead"),
    ("launch_overhead_s", 0.0, 5e-4, 5e-6, "s", "overhead"),
    ("graph_host_overhead_s", 0.0, 5e-3, 1e-5, "s", "overhead"),
    ("graph_launch_overhead_s", 0.0, 5e-5, 1e-6, "s", "overhead"),
    ("kernel_device_s", 0.0, 1e-4, 2e-6, "s", "overhead"),
    ("bandwidth_efficiency", 0.01, 1.0, 0.8, "fraction of peak", "fraction"),
    ("kv_bandwidth_efficiency", 0.01, 1.0, 0.8, "fraction of peak", "fraction"),
    ("flops_efficiency", 0.01, 1.0, 0.7, "fraction of peak", "fraction"),
    ("attention_flops_efficiency", 0.005, 1.0, 0.2, "fraction of peak", "fraction"),
    ("matmul_time_scale", 0.2, 5.0, 1.0, "x the measured curve", "scale"),
]]
# Each mode's host terms; the rest of a GPU's coefficients are the device's, shared by the modes.
# A GPU's eager host pays per call, per operation launched and for its attention's shape; no per
# layer term: a layer's operations are counted, and a per-layer constant would be their launch
# cost under another name (the H200's calls could not tell them apart).
MODE_TERMS = {"eager": ("host_overhead_s", "attention_one_set_host_s",
                        "attention_grouped_host_s", "launch_overhead_s"),
              "graphs": ("graph_host_overhead_s", "graph_launch_overhead_s")}
# A CPU's products are priced by the measured curve (its flops and weight bandwidth are in it);
# the rest of a call's traffic, KV included, shares one efficiency. It runs eagerly.
CPU_PARAMETERS = [p for p in PARAMETERS
                  if p.name not in ("kv_bandwidth_efficiency", "flops_efficiency",
                                    "kernel_device_s", "attention_one_set_host_s",
                                    "attention_grouped_host_s", *MODE_TERMS["graphs"])]
GPU_PARAMETERS = [p for p in PARAMETERS if p.name not in ("matmul_time_scale", "layer_overhead_s",
                                                       "attention_key_set_s")]


def parameters_for(hw: HardwareSpec, modes: Sequence[str] | None = None) -> list[Parameter]:
    """The coefficients a fit frees: a CPU's set, or a GPU's device coefficients with the host
    terms of the ``modes`` its calls ran in (default: the hardware's own mode). A mode whose
    calls are not in the fit keeps its host terms as they are. The device's time per kernel
    needs graphs calls: in eager calls alone it is the host's launch cost under another name
    (the larger of the two hides the other), so an eager fit keeps it as it is (EAGER_HELD)."""
    if hw.cpu is not None:
        return CPU_PARAMETERS
    modes = set(modes or [hw.mode])
    other = {t for m, terms in MODE_TERMS.items() if m not in modes for t in terms}
    return [p for p in GPU_PARAMETERS if p.name not in other | set(eager_held(hw, modes))]


EAGER_HELD = {"kernel_device_s": "eager calls cannot tell it from the host's launch cost: held at "
                                 "its prior or the replay microbenchmark's figure"}


def eager_held(hw: HardwareSpec, modes: Sequence[str]) -> dict[str, str]:
    """What a GPU fit on these modes' calls holds, and why: EAGER_HELD without graphs calls."""
    return EAGER_HELD if hw.cpu is None and "graphs" not in modes else {}


# Microbenchmarks a GPU calibration records (calibrate.operations.graph_replay_costs), by profile
# coefficient, and the coefficient each starts from in place of its prior: a graphs-mode
# prediction from an eager fit stands on them.
MICROBENCHMARKS = {"replay_host_s": "graph_host_overhead_s",
                   "replay_kernel_device_s": "kernel_device_s"}


def prior(name: str) -> float:
    return next(p.start for p in PARAMETERS if p.name == name)


@dataclass
class Observation:
    model: LoopedModelSpec
    record: CallRecord
    seconds: float
    mode: str | None = None  # "eager" or "graphs": the mode it ran in (None: the hardware's)
    features: dict | None = field(default=None, repr=False, compare=False)


@dataclass
class FitResult:
    hardware: HardwareSpec
    values: dict[str, float]  # the fitted coefficients
    stderr: dict[str, float]
    dropped: dict[str, str]  # coefficients taken out: why, and the value held
    residuals: np.ndarray  # relative errors on the training points
    cost: float

    def coefficients(self) -> dict[str, FittedValue]:
        units = {p.name: p.unit for p in PARAMETERS}
        return {name: FittedValue(value=value, stderr=self.stderr[name], unit=units[name])
                for name, value in self.values.items()}

    def held(self) -> dict[str, HeldValue]:
        return {name: HeldValue(value=float(self.hardware.term(name)),
                                prior="prior" in why, reason=why)
                for name, why in self.dropped.items()}

    def stats(self) -> dict[str, float]:
        rel = np.abs(self.residuals)
        return {"train_points": len(rel), "median_abs_rel_residual": float(np.median(rel)),
                "max_abs_rel_residual": float(rel.max()), "cost": self.cost}


def _features(obs: Sequence[Observation]) -> list[dict]:
    """What the cost model reads of each call, worked out once per observation (a fit prices
    the same calls thousands of times)."""
    for o in obs:
        if o.features is None:
            slot_ctx = o.record.slot_contexts()
            # calls of equal models are priced together, however many copies of the spec
            o.features = {"model": o.model, "model_key": o.model.model_dump_json(),
                          "part": o.model.part(o.record.kind),
                          "n": len(o.record.positions), "slots": len(slot_ctx),
                          "ctx_pos": sum(o.record.contexts),
                          "ctx_slots": sum(slot_ctx.values())}
    return [o.features for o in obs]


def predict_calls(hw: HardwareSpec, obs: Sequence[Observation], dtype: str) -> np.ndarray:
    """Each call's predicted time: one vectorised ``call_cost`` per model, part and mode."""
    out = np.empty(len(obs))
    modes = {o.mode: hw.in_mode(o.mode) for o in obs}
    groups: dict[tuple, list[tuple[int, dict]]] = {}
    for i, (o, f) in enumerate(zip(obs, _features(obs), strict=True)):
        groups.setdefault((f["model_key"], f["part"].name, o.mode), []).append((i, f))
    for (_, _, mode), members in groups.items():
        first = members[0][1]
        column = {key: np.array([f[key] for _, f in members])
                  for key in ("n", "slots", "ctx_pos", "ctx_slots")}
        c = call_cost(first["model"], modes[mode], first["part"], dtype,
                      n_positions=column["n"], n_slots=column["slots"],
                      context_sum_positions=column["ctx_pos"],
                      context_sum_slots=column["ctx_slots"], key_sets=column["slots"])
        out[[i for i, _ in members]] = np.broadcast_to(c.time_s, len(members))
    return out


def _with(base: HardwareSpec, parameters: Sequence[Parameter], theta: np.ndarray
          ) -> HardwareSpec:
    return base.with_terms(**{p.name: float(v)
                              for p, v in zip(parameters, theta, strict=True)})


def undetermined(hw: HardwareSpec, obs: Sequence[Observation], dtype: str,
                 parameters: Sequence[Parameter] | None = None, step: float = 0.1,
                 tolerance: float = 0.01) -> set[str]:
    """The coefficients (of ``parameters``; default: those a fit of ``hw`` frees) the training
    calls do not determine: those lying mostly along directions where the Jacobian of the calls'
    log times in their relative changes is singular (singular values under ``tolerance``: a 100%
    change moves no time by 1%), such as flops under an eager GPU decoder's host-bound calls. The
    Jacobian's standard errors read near zero there."""
    parameters = parameters_for(hw) if parameters is None else parameters
    # a coefficient the spec leaves unset (attention's efficiency: the projections') at its start
    hw = hw.with_terms(**{p.name: p.start for p in parameters if hw.term(p.name) is None})
    columns = []
    for name, lower, upper, start, *_ in parameters:  # a Parameter's fields, in order
        value = hw.term(name)
        scale = max(abs(value), abs(start))
        low, high = max(lower, value - step * scale), min(upper, value + step * scale)
        if high <= low:
            columns.append(np.zeros(len(obs)))
            continue
        times = [np.log(predict_calls(hw.with_terms(**{name: float(v)}), obs, dtype))
                 for v in (low, high)]
        columns.append((times[1] - times[0]) / ((high - low) / scale))
    _, singular, vt = np.linalg.svd(np.column_stack(columns), full_matrices=True)
    null = vt[int(np.sum(singular > tolerance)):]
    share = np.sum(null**2, axis=0)  # each coefficient's share in the undetermined directions
    return {p.name for p, w in zip(parameters, share, strict=True) if w > 0.5}


def _solve(base: HardwareSpec, obs: Sequence[Observation], dtype: str,
           parameters: Sequence[Parameter]) -> tuple[np.ndarray, np.ndarray, float]:
    """(values, standard errors, cost) of a least-squares fit of ``parameters``."""
    from scipy.optimize import least_squares

    measured = np.array([o.seconds for o in obs])
    lower = np.array([p.lower for p in parameters])
    upper = np.array([p.upper for p in parameters])
    start = np.array([p.start for p in parameters])

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(predict_calls(_with(base, parameters, theta), obs, dtype)) - np.log(
            measured)

    starts = [start]
    if base.host.overhead_overlaps:
        # where the host's time overlaps the device's, a host term hidden behind the device at
        # the start moves no call and would stay there: start also from host terms large enough
        # to show in every call, and keep the better fit
        starts.append(np.where([p.kind == "overhead" for p in parameters],
                               np.minimum(start * 30, upper), start))
    res = min((least_squares(residual, x0, bounds=(lower, upper), loss="soft_l1",
                             f_scale=F_SCALE, x_scale="jac") for x0 in starts),
              key=lambda r: r.cost)
    dof = max(len(measured) - len(start), 1)
    sigma2 = float(np.sum(res.fun**2) / dof)
    try:
        stderr = np.sqrt(np.clip(np.diag(np.linalg.pinv(res.jac.T @ res.jac) * sigma2), 0, None))
    except np.linalg.LinAlgError:
        stderr = np.full(len(start), np.inf)
    return res.x, stderr, float(res.cost)


def _weak(hw: HardwareSpec, obs: Sequence[Observation], dtype: str,
          parameters: Sequence[Parameter], values: np.ndarray, stderr: np.ndarray
          ) -> dict[str, str]:
    """The fitted coefficients the calls do not determine, each with why: in a direction the
    calls do not constrain, an overhead fitted at zero, or a standard error above its value."""
    loose = undetermined(hw, obs, dtype, parameters)
    weak = {}
    for p, value, error in zip(parameters, values, stderr, strict=True):
        if p.name in loose:
            weak[p.name] = "not determined by the calls"
        elif p.kind == "overhead" and value <= 1e-9:
            weak[p.name] = "fitted at zero"
        elif not value or error > abs(value):
            weak[p.name] = f"its standard error was {error / abs(value) if value else np.inf:.0%}" \
                         " of its value"
    return weak


def fit(base: HardwareSpec, obs: Sequence[Observation], dtype: str,
        parameters: Sequence[Parameter] | None = None) -> FitResult:
    """Fit the free coefficients of ``base`` (whose peaks, curve and kernel counts are the
    measured ones) to ``obs``: those of ``parameters`` (rows of PARAMETERS; default: the CPU's
    or the GPU's set); the others keep their values in ``base``. Coefficients the calls do not
    determine are taken out one at a time (module docstring)."""
    modes = sorted({o.mode or base.mode for o in obs})
    free = list(parameters if parameters is not None else parameters_for(base, modes))
    dropped = dict(eager_held(base, modes)) if parameters is None else {}
    hw = fitted_hw = base
    values, stderr, cost = np.array([]), np.array([]), float("nan")
    if free:
        values, stderr, cost = _solve(hw, obs, dtype, free)
        fitted_hw = _with(hw, free, values)
    while free:
        weak = _weak(fitted_hw, obs, dtype, free, values, stderr)
        if not weak:
            break
        # of the weak ones, take out the one whose absence the calls miss least: the simpler
        # structure that fits best (two collinear overheads: the one the other replaces)
        trials = []
        for row in (p for p in free if p.name in weak):
            rest = [p for p in free if p is not row]
            trial_hw = hw.with_terms(**{row.name: row.held})
            trial = _solve(trial_hw, obs, dtype, rest) if rest else (
                np.array([]), np.array([]), float("nan"))
            trials.append((row, trial_hw, rest, trial))
        # (with nothing left to fit, the removal costs nothing more)
        row, hw, free, (values, stderr, cost) = min(trials,
                                                    key=lambda t: t[3][2] if t[2] else 0.0)
        fitted_hw = _with(hw, free, values)
        dropped[row.name] = (f"{weak[row.name]}: dropped (0)" if row.kind == "overhead"
                             else f"{weak[row.name]}: held at its prior {row.held:g}")
    measured = np.array([o.seconds for o in obs])
    predicted = predict_calls(fitted_hw, obs, dtype)
    rel = predicted / measured - 1
    if not free:  # nothing left to fit: the loss the fit would minimize, at the held values
        z = (np.log(predicted / measured) / F_SCALE) ** 2
        cost = float(F_SCALE**2 * np.sum(np.sqrt(1 + z) - 1))  # least_squares' soft-L1 cost
    return FitResult(hardware=fitted_hw,
                     values={p.name: float(v) for p, v in zip(free, values, strict=True)},
                     stderr={p.name: float(v) for p, v in zip(free, stderr, strict=True)},
                     dropped=dropped, residuals=rel, cost=cost)
