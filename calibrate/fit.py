"""Fit the cost model's coefficients to measured calls.

The fitted quantity is the cost model itself: ``costmodel.cost.call_cost`` with a hardware spec
whose coefficients are free (host overhead per call and per layer, launch overhead per kernel,
achievable fractions of the measured peak bandwidth for weights and for KV and of the measured peak
flops, and how often a blocked matrix product streams the weights; the row count where the library
switches to blocked products is measured, not fitted, and so on a CPU are the threads' regime and
the flops of thin products), how the passes of vector products grow with their rows, the fixed time
of each blocked matrix product, and the fraction of peak flops attention reaches. Robust least
squares (scipy.optimize.least_squares, soft-L1 loss) on log times, so every call weighs by its
relative error; standard errors from the Jacobian at the optimum, none for a coefficient the
training calls do not depend on (``undetermined``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.cost import call_cost
from costmodel.specs import HardwareSpec, LoopedModelSpec
from costmodel.trace import CallRecord

# name, HardwareSpec field, lower bound, upper bound, initial value, unit
F_SCALE = 0.05
PARAMETERS = [
    ("host_overhead_s", 0.0, 5e-3, 2e-5, "s"),
    ("launch_overhead_s", 0.0, 5e-4, 5e-6, "s"),
    ("layer_overhead_s", 0.0, 5e-3, 1e-5, "s per layer"),
    ("bandwidth_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("layer_stream_latency_s", 0.0, 5e-3, 5e-5, "s per layer streamed from memory"),
    ("kv_bandwidth_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("flops_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("attention_flops_efficiency", 0.005, 1.0, 0.2, "fraction of peak"),
    ("gemv_row_passes", 0.0, 1.0, 0.8, "weight passes per extra row of vector products"),
    ("gemv_row_exponent", 0.3, 1.0, 0.8, "exponent of the extra rows' passes"),
    ("blocked_gemm_weight_passes", 1.0, 8.0, 1.5, "weight passes of a blocked product"),
    ("blocked_gemm_latency_s", 0.0, 1e-3, 5e-6, "s per blocked matrix product"),
    ("roofline_exponent", 1.0, 16.0, 3.0, "p of the p-norm of memory and compute time"),
]


def fitted_parameters(coefficients: dict) -> list[tuple]:
    """The rows of PARAMETERS a profile fitted: those among its coefficients that were not
    measured (a CPU's projections' flops efficiency is measured; a GPU's is fitted)."""
    return [p for p in PARAMETERS if p[0] in coefficients
            and not coefficients[p[0]].unit.endswith("(measured)")]


@dataclass
class Observation:
    model: LoopedModelSpec
    record: CallRecord
    seconds: float


@dataclass
class FitResult:
    hardware: HardwareSpec
    values: dict[str, float]
    stderr: dict[str, float | None]  # None: not determined by the training calls
    residuals: np.ndarray  # relative errors on the training points
    cost: float


def _features(obs: Sequence[Observation]) -> list[dict]:
    feats = []
    for o in obs:
        slot_ctx = o.record.slot_contexts()
        feats.append({"model": o.model, "part": o.model.part(o.record.kind),
                      "n": len(o.record.positions), "slots": len(slot_ctx),
                      "ctx_pos": sum(o.record.contexts), "ctx_slots": sum(slot_ctx.values())})
    return feats


def predict_calls(hw: HardwareSpec, obs: Sequence[Observation], dtype: str) -> np.ndarray:
    out = np.empty(len(obs))
    for i, f in enumerate(_features(obs)):
        c = call_cost(f["model"], hw, f["part"], dtype, n_positions=f["n"], n_slots=f["slots"],
                      context_sum_positions=f["ctx_pos"], context_sum_slots=f["ctx_slots"])
        out[i] = float(c.time_s)
    return out


def _with(base: HardwareSpec, parameters: Sequence[tuple], theta: np.ndarray) -> HardwareSpec:
    return base.model_copy(update={name: float(v) for (name, *_), v in
                                   zip(parameters, theta, strict=True)})


def undetermined(hw: HardwareSpec, obs: Sequence[Observation], dtype: str,
                 parameters: Sequence[tuple] = PARAMETERS, step: float = 0.1,
                 tolerance: float = 0.01) -> set[str]:
    """The coefficients the training calls do not determine. The Jacobian of the calls' log times
    in the coefficients' relative changes (central differences of ``step``, within the bounds)
    is singular along some directions (singular values under ``tolerance``: a change of 100%
    that way moves no time by 1%); a coefficient that lies mostly in them is not determined. On a
    GPU where the host's launches hide the device's work (an eager decoder), flops are: no call
    depends on them. So are bandwidth and the weight passes when one call alone is device-bound.
    The standard errors from the Jacobian's pseudo-inverse read near zero for both."""
    # a coefficient the spec leaves unset (attention's efficiency: the projections') at its start
    hw = hw.model_copy(update={p[0]: p[3] for p in parameters if getattr(hw, p[0]) is None})
    columns = []
    for name, lower, upper, start, _ in parameters:
        value = getattr(hw, name)
        scale = max(abs(value), abs(start))
        low, high = max(lower, value - step * scale), min(upper, value + step * scale)
        if high <= low:
            columns.append(np.zeros(len(obs)))
            continue
        times = [np.log(predict_calls(hw.model_copy(update={name: float(v)}), obs, dtype))
                 for v in (low, high)]
        columns.append((times[1] - times[0]) / ((high - low) / scale))
    _, singular, vt = np.linalg.svd(np.column_stack(columns), full_matrices=True)
    null = vt[int(np.sum(singular > tolerance)):]
    share = np.sum(null**2, axis=0)  # each coefficient's share in the undetermined directions
    return {p[0] for p, w in zip(parameters, share, strict=True) if w > 0.5}


def fit(base: HardwareSpec, obs: Sequence[Observation], dtype: str,
        parameters: Sequence[tuple] = PARAMETERS) -> FitResult:
    """Fit the free coefficients of ``base`` (whose peaks and blocked-product row count are the
    measured ones) to ``obs``: those of ``parameters`` (rows of PARAMETERS); the others keep
    their values in ``base``."""
    from scipy.optimize import least_squares

    measured = np.array([o.seconds for o in obs])
    lower = np.array([p[1] for p in parameters])
    upper = np.array([p[2] for p in parameters])
    start = np.array([p[3] for p in parameters])

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(predict_calls(_with(base, parameters, theta), obs, dtype)) - np.log(
            measured)

    res = least_squares(residual, start, bounds=(lower, upper), loss="soft_l1", f_scale=F_SCALE,
                        x_scale="jac")
    dof = max(len(measured) - len(start), 1)
    sigma2 = float(np.sum(res.fun**2) / dof)
    try:
        cov = np.linalg.pinv(res.jac.T @ res.jac) * sigma2
        stderr = np.sqrt(np.clip(np.diag(cov), 0, None))
    except np.linalg.LinAlgError:
        stderr = np.full(len(start), np.nan)
    hw = _with(base, parameters, res.x)
    rel = predict_calls(hw, obs, dtype) / measured - 1
    loose = undetermined(hw, obs, dtype, parameters)
    return FitResult(hardware=hw,
                     values={p[0]: float(v) for p, v in zip(parameters, res.x, strict=True)},
                     stderr={p[0]: None if p[0] in loose else float(v)
                             for p, v in zip(parameters, stderr, strict=True)},
                     residuals=rel, cost=float(res.cost))
