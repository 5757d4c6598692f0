"""Fit the cost model's coefficients to measured calls.

The fitted quantity is the cost model itself: ``costmodel.cost.call_cost`` with a hardware spec
whose coefficients are free (host overhead per call, launch overhead per kernel, achievable
fractions of the measured peak bandwidth for weights and for KV and of the measured peak flops,
and the small-row weight re-streaming fraction and its limit). Robust least squares
(scipy.optimize.least_squares, soft-L1 loss) on log times, so every call weighs by its relative
error; standard errors from the Jacobian at the optimum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.cost import call_cost
from costmodel.specs import HardwareSpec, LoopedModelSpec
from costmodel.trace import CallRecord

# name, HardwareSpec field, lower bound, upper bound, initial value, unit
PARAMETERS = [
    ("host_overhead_s", 0.0, 5e-3, 2e-5, "s"),
    ("launch_overhead_s", 0.0, 5e-4, 5e-6, "s"),
    ("bandwidth_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("kv_bandwidth_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("flops_efficiency", 0.01, 1.0, 0.5, "fraction of peak"),
    ("row_pass_fraction", 0.0, 1.0, 0.1, "weight passes per extra row"),
]


@dataclass
class Observation:
    model: LoopedModelSpec
    record: CallRecord
    seconds: float


@dataclass
class FitResult:
    hardware: HardwareSpec
    values: dict[str, float]
    stderr: dict[str, float]
    row_pass_limit: int
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


def _with(base: HardwareSpec, theta: np.ndarray, limit: int) -> HardwareSpec:
    update = {name: float(v) for (name, *_), v in zip(PARAMETERS, theta, strict=True)}
    update["row_pass_limit"] = limit
    return base.model_copy(update=update)


def fit(base: HardwareSpec, obs: Sequence[Observation], dtype: str,
        row_pass_limits: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> FitResult:
    """Fit the free coefficients of ``base`` (whose peaks are the measured ones) to ``obs``.

    The integer ``row_pass_limit`` is chosen by trying each candidate."""
    from scipy.optimize import least_squares

    measured = np.array([o.seconds for o in obs])
    lower = np.array([p[1] for p in PARAMETERS])
    upper = np.array([p[2] for p in PARAMETERS])
    start = np.array([p[3] for p in PARAMETERS])
    best = None
    for limit in row_pass_limits:
        def residual(theta: np.ndarray, limit: int = limit) -> np.ndarray:
            return np.log(predict_calls(_with(base, theta, limit), obs, dtype)) - np.log(measured)

        res = least_squares(residual, start, bounds=(lower, upper), loss="soft_l1", f_scale=0.05,
                            x_scale="jac")
        if best is None or res.cost < best[0].cost:
            best = (res, limit)
    res, limit = best
    jac = res.jac
    dof = max(len(measured) - len(start), 1)
    sigma2 = float(np.sum(res.fun**2) / dof)
    try:
        cov = np.linalg.pinv(jac.T @ jac) * sigma2
        stderr = np.sqrt(np.clip(np.diag(cov), 0, None))
    except np.linalg.LinAlgError:
        stderr = np.full(len(start), np.nan)
    hw = _with(base, res.x, limit)
    rel = predict_calls(hw, obs, dtype) / measured - 1
    return FitResult(hardware=hw,
                     values={p[0]: float(v) for p, v in zip(PARAMETERS, res.x, strict=True)},
                     stderr={p[0]: float(v) for p, v in zip(PARAMETERS, stderr, strict=True)},
                     row_pass_limit=limit, residuals=rel, cost=float(res.cost))
