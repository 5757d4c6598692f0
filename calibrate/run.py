"""Calibrate the cost model on this machine: measure peaks and calls, fit, validate, save.

Models per family, by default: the shipped tiny model (or its random twin, or a given checkpoint)
and the ~420 MB "mid" random-weight variant are fitted (overhead-bound and bandwidth-bound on a
CPU); the ~100 MB "small" variant is held out. Calls of the fitted models are fitted on positions
per call in ``TRAIN_POSITIONS`` at the shortest context; every other call, and whole AR, DtV and
WFD runs of the held-out size at several draft depths, are held out for validation.
"""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from costmodel.presets import MODELS
from costmodel.profile import CalibrationProfile, FittedValue
from costmodel.specs import HardwareSpec
from costmodel.trace import current_commit

from .fit import PARAMETERS, Observation, fit
from .measure import (
    FULL,
    QUICK,
    CallSample,
    Grid,
    call_grid,
    contexts_for,
    measure_runs,
    time_call,
)
from .validate import ValidationPoint, run_point

TRAIN_POSITIONS = (1, 2, 4)


def machine_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_peaks(device: str, dtype: str) -> tuple[float, float]:
    """(bytes/s of a large copy, flop/s of a large matrix product): the peaks the fitted
    efficiencies are fractions of."""
    import torch

    from wfd.checkpoint import DTYPES

    dev = torch.device(device)
    dt = DTYPES[dtype]
    src = torch.empty(64 * 2**20 // DTYPES[dtype].itemsize * 4, dtype=dt, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    a = torch.randn(1024, 1024, device=dev).to(dt)
    b = torch.randn(1024, 1024, device=dev).to(dt)

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    bandwidth = 2 * src.numel() * src.element_size() / best(lambda: dst.copy_(src))
    flops = 2 * 1024**3 / best(lambda: a @ b)
    return bandwidth, flops


def default_models(family: str, checkpoint: str | None) -> tuple[list[str], str]:
    """(models the fit uses, the model size held out): the checkpoint or shipped tiny model and
    the ~420 MB random variant are fitted, the ~100 MB one is held out."""
    from wfd.checkpoint import shipped_models

    tiny = checkpoint or (f"{family}-tiny" if f"{family}-tiny" in shipped_models()
                          else f"{family}-tiny:random")
    return [tiny, f"{family}-mid:random"], f"{family}-small:random"


def spec_for(name: str, model) -> object:
    preset = name.removesuffix(":random")
    if preset in MODELS:
        return MODELS[preset]
    return model.config.to_spec(name)


def calibrate(family: str, *, checkpoint: str | None = None, device: str = "cpu",
              dtype: str = "fp32", quick: bool = False, threads: int | None = None,
              fit_models: list[str] | None = None, holdout_model: str | None = None,
              progress=None) -> CalibrationProfile:
    import torch

    from wfd.checkpoint import CheckpointError, load_model

    if threads:
        torch.set_num_threads(threads)
    grid: Grid = QUICK if quick else FULL
    default_fit, default_holdout = default_models(family, checkpoint)
    roles = {f"fit{i}": name for i, name in enumerate(fit_models or default_fit)}
    roles["holdout"] = holdout_model or default_holdout
    peak_bw, peak_flops = measure_peaks(device, dtype)
    base = HardwareSpec(name=f"{machine_name(device)} ({device}, {dtype}, calibrated)",
                        memory_bandwidth_bytes_per_s=peak_bw,
                        peak_flops_per_s={dtype: peak_flops},
                        memory_capacity_bytes=_memory_capacity(device),
                        overhead_overlaps=device.startswith("cuda"))
    loaded = {}
    for role, name in roles.items():
        model = load_model(name, device=device, dtype=dtype)
        if model.config.family != family:
            raise CheckpointError(f"{name} is a {model.config.family} model, not {family}")
        loaded[role] = (name, model, spec_for(name, model))

    plan = []
    for role in roles:
        name, model, _ = loaded[role]
        # touch every weight and warm the allocator before anything is timed
        time_call(model, name, "block", max(grid.positions), max(contexts_for(model, grid)), 1,
                  Grid(positions=[1], contexts=[1], repeats=1, warmup=3))
        plan += [(role, point) for point in call_grid(name, model, grid)]
    task = progress.add_task("measuring calls", total=len(plan) + 3) if progress else None
    samples: list[tuple[str, CallSample]] = []
    for role, (kind, n, context, slots) in plan:
        name, model, _ = loaded[role]
        if progress:
            progress.update(task, description=f"{name}: {kind} n={n} context={context} "
                                              f"slots={slots}")
        samples.append((role, time_call(model, name, kind, n, context, slots, grid)))
        if progress:
            progress.advance(task)

    def obs(role: str, s: CallSample) -> Observation:
        return Observation(model=loaded[role][2], record=s.record, seconds=s.median_s)

    def in_training(role: str, s: CallSample) -> bool:
        return role != "holdout" and len(s.record.positions) in TRAIN_POSITIONS

    train = [obs(r, s) for r, s in samples if in_training(r, s)]
    result = fit(base, train, dtype)
    points = [ValidationPoint(
        kind="call", model=s.model, spec=loaded[r][2], group=s.record.kind, measured_s=s.median_s,
        label=f"{s.record.kind} n={len(s.record.positions)} context={min(s.record.contexts) - 1}"
              f" slots={len(s.record.slot_contexts())}", record=s.record)
        for r, s in samples if not in_training(r, s)]
    name, model, spec = loaded["holdout"]
    depth = model.config.depth
    prompt = [32 + (i * 7) % 90 for i in range(64)]
    tokens = 24 if quick else 48
    drafts = sorted({max(1, -(-depth // 8)), max(1, depth // 4)})
    schedules = [("ar", {})] + [("wfd", {"draft_depth": d}) for d in drafts] + [
        ("dtv", {"draft_depth": d, "block_length": 4}) for d in drafts]
    for schedule, kw in schedules:
        if progress:
            progress.update(task, description=f"{name}: {schedule} run {kw}")
        run = measure_runs(name, model, prompt, tokens, [(schedule, kw)], forced=0.85)[0]
        points.append(run_point(name, spec, run, len(prompt), depth))
    if progress:
        progress.advance(task, 3)

    fitted = {p[0]: FittedValue(value=result.values[p[0]], stderr=result.stderr[p[0]],
                                unit=p[4]) for p in PARAMETERS}
    fitted["row_pass_limit"] = FittedValue(value=result.row_pass_limit, stderr=0.0,
                                           unit="positions")
    fitted["peak_bandwidth"] = FittedValue(value=peak_bw, stderr=0.0, unit="B/s (measured)")
    fitted["peak_flops"] = FittedValue(value=peak_flops, stderr=0.0, unit="flop/s (measured)")
    rel = np.abs(result.residuals)
    profile = CalibrationProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        hardware=result.hardware, machine=machine_name(device), device=device,
        torch_version=torch.__version__, dtype=dtype, commit=current_commit(),
        models=[n for n, _, _ in loaded.values()],
        grid={"positions": list(grid.positions), "contexts": list(grid.contexts),
              "repeats": [grid.repeats],
              "train_positions": list(TRAIN_POSITIONS),
              "train_models": [loaded[r][0] for r in roles if r != "holdout"]},
        coefficients=fitted,
        fit_stats={"train_points": len(train), "median_abs_rel_residual": float(np.median(rel)),
                   "max_abs_rel_residual": float(rel.max()), "cost": result.cost},
        validation=points,
    )
    return profile


def _memory_capacity(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9
