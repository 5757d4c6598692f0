"""Calibrate the cost model on this machine: measure peaks and calls, fit, validate, save.

Models per family, by default: the shipped tiny model (or its random twin, or a given checkpoint)
and the ~100 MB "small" and ~420 MB "mid" random-weight variants are fitted (overhead-bound and
bandwidth-bound on a CPU); the ~230 MB "base" variant is held out. Calls of the fitted models are
fitted at ``TRAIN_POSITIONS`` positions per call and at the shortest and longest context of the
grid; every other call (other positions per call, the contexts between), every call of the
held-out size, and whole AR, DtV and WFD runs of the held-out size at several draft depths are
held out for validation.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from costmodel.hardware import HardwareSpec
from costmodel.plans import default_draft_depth
from costmodel.presets import MODELS
from costmodel.profile import (
    CalibrationProfile,
    FittedValue,
    LoadReport,
    ProfileError,
    load_profile,
)
from costmodel.trace import current_commit
from wfd.timing import CallSample, Grid, Quiet, time_call, warm_up

from .curve import CURVE_ROWS, CURVE_ROWS_QUICK
from .fit import MICROBENCHMARKS, Observation, fit, prior
from .machine import Peaks, measure_peaks
from .measure import FULL, QUICK, call_grid, contexts_for, measure_runs
from .operations import decoder_operations, graph_replay_costs, operation_host_weights
from .refit import with_streamed_start
from .validate import ValidationPoint, run_point

TRAIN_POSITIONS = (1, 2, 3, 4, 32)
# the held-out runs' forced acceptance, unless a sweep is asked for (--acceptances)
DEFAULT_ACCEPTANCE = 0.85
# A calibration whose measurements ran at speeds this far apart (the canary's 90th percentile
# over its 10th) measured a machine whose speed kept changing: its figures do not describe one
# machine, and its profile is refused (--force writes it, flagged). The canary's level against
# its fastest is reported, not judged: the fastest of hundreds of samples is an extreme, and a
# shared machine's sustained work sits well above it in any hour, so the level cannot tell a
# busy machine from a steady one (the sustained-calibration record in docs/results/).
BUSY_SPREAD = 1.8


def starting_terms(cuda: bool, replay: dict[str, float]) -> dict[str, float]:
    """Hardware terms a GPU fit starts from other than their priors, each given once: the
    device time per kernel (an eager fit cannot determine it, calibrate.fit.EAGER_HELD) and the
    graph replay's host cost, at what the replay microbenchmarks measured where they ran
    (calibrate.fit.MICROBENCHMARKS), else the per-kernel time at its prior. A CPU has none."""
    if not cuda:
        return {"kernel_device_s": 0.0}
    starts = {"kernel_device_s": prior("kernel_device_s")}
    starts.update({field: replay[key] for key, field in MICROBENCHMARKS.items() if key in replay})
    return starts


def too_busy(load: LoadReport | None) -> str | None:
    """Why a fresh calibration's figures are meaningless (its load report has the canary's
    spread), or None."""
    if load is None:
        return None
    spread = load.canary_p90 / load.canary_p10
    if spread <= BUSY_SPREAD:
        return None
    return (f"the machine's speed kept changing while it was measured: the canary product "
            f"ran {spread:.2f}x slower at its 90th percentile than at its 10th (more than "
            f"{BUSY_SPREAD}x; median {load.canary_median:.2f}x its fastest, "
            f"{load.loaded_fraction:.0%} of measurements over {load.canary_tolerance}x after "
            f"taking {load.retaken_fraction:.0%} again); calibrate on a quiet machine, or pass "
            "--force to write the profile anyway (flagged)")


def default_models(family: str, checkpoint: str | None) -> tuple[list[str], str]:
    """(models the fit uses, the model size held out): the checkpoint or shipped tiny model and
    the ~100 MB and ~420 MB random variants are fitted, the ~230 MB one is held out."""
    from wfd.checkpoint import shipped_models

    tiny = checkpoint or (f"{family}-tiny" if f"{family}-tiny" in shipped_models()
                          else f"{family}-tiny:random")
    return [tiny, f"{family}-small:random", f"{family}-mid:random"], f"{family}-base:random"


def spec_for(name: str, model) -> object:
    preset = name.removesuffix(":random")
    if preset in MODELS:
        return MODELS[preset]
    return model.config.to_spec(name)


def reused_peaks(path: Path, device: str, dtype: str, force: bool = False) -> Peaks:
    """The machine measurements (peaks, cache, a CPU's product curve) of an earlier profile,
    instead of measuring again: a second family on the same machine needs none of its own. A
    profile of another machine, device kind, dtype or thread count is refused unless ``force``
    (then said in the profile's checks)."""
    import torch

    from wfd.checkpoint import CheckpointError
    from wfd.runtime import machine_name

    try:
        prof = load_profile(path)
    except ProfileError as exc:
        raise CheckpointError(f"--machine-from: {exc}") from None
    threads = None if device.startswith("cuda") else torch.get_num_threads()
    differ = [f"{what} {theirs} (here {ours})" for what, theirs, ours in (
        ("machine", prof.machine, machine_name(device)),
        ("device", prof.device.split(":")[0], device.split(":")[0]),
        ("dtype", prof.dtype, dtype), ("threads", prof.threads, threads)) if theirs != ours]
    if differ and not force:
        raise CheckpointError(f"--machine-from {path} was measured with another setting: "
                              f"{', '.join(differ)}; drop --machine-from or pass --force")
    measured = prof.coefficients

    def value(name: str) -> float:
        return measured[name].value if name in measured else 0.0

    checks = [c for c in prof.checks if c.startswith(("cache:", "matrix products", "peak flops"))]
    reused = f"machine: the measurements of {path.name} ({prof.created[:16]}) reused" + (
        f", taken with {', '.join(differ)}" if differ else "")
    return Peaks(bandwidth_bytes_per_s=value("peak_bandwidth"), flops_per_s=value("peak_flops"),
                 reported_cache_bytes=value("reported_cache"), cache_bytes=value("cache_knee"),
                 matmul=with_streamed_start(prof.hardware, measured).cpu.matmul,
                 checks=[reused, *checks])


def calibrate(family: str, *, checkpoint: str | None = None, device: str = "cpu",
              dtype: str = "fp32", quick: bool = False, threads: int | None = None,
              fit_models: list[str] | None = None, holdout_model: str | None = None,
              mode: str = "eager", progress=None, machine_from: Path | None = None,
              force: bool = False, acceptances: list[float] | None = None,
              retries: int | None = None) -> CalibrationProfile:
    import torch

    from wfd.checkpoint import CheckpointError, load_model
    from wfd.runtime import machine_name

    if threads:
        torch.set_num_threads(threads)
    grid: Grid = QUICK if quick else FULL
    default_fit, default_holdout = default_models(family, checkpoint)
    roles = {f"fit{i}": name for i, name in enumerate(fit_models or default_fit)}
    roles["holdout"] = holdout_model or default_holdout
    loaded = {}  # the models first: a wrong checkpoint fails before a minute of measuring
    for role, name in roles.items():
        model = load_model(name, device=device, dtype=dtype)
        if model.config.family != family:
            raise CheckpointError(f"{name} is a {model.config.family} model, not {family}")
        loaded[role] = (name, model, spec_for(name, model))
    cuda = device.startswith("cuda")
    # a GPU is not shared: a slow canary there is launch jitter, not load, and is not retried
    quiet = Quiet(device, retries=(0 if cuda else 4) if retries is None else retries,
                  budget_s=60.0 if quick else 120.0)
    if machine_from is not None:
        peaks = reused_peaks(machine_from, device, dtype, force)
    else:
        machine_task = progress.add_task("measuring the machine: bandwidth, flops, matrix "
                                         "products", total=None) if progress else None
        peaks = measure_peaks(device, dtype, quiet, CURVE_ROWS_QUICK if quick else CURVE_ROWS)
        if progress:
            progress.remove_task(machine_task)
    # Kernels are the decoder's dispatched operations, counted; attention over several KV slots
    # is one of them (a wave is batched), so attention adds no kernels per slot. On a GPU the
    # classes are priced apart: each its measured host time, views no kernel (a CPU's products
    # are in its curve, and its calibration keeps one cost per operation).
    ops = decoder_operations([m for r, (_, m, _) in loaded.items() if r != "holdout"])
    per_layer, extras = ops.per_layer, ops.extras
    by_class: dict = {}
    if cuda:
        try:
            by_class = {"layer_operations": ops.layer_by_class,
                        "part_extra_operations": ops.extras_by_class,
                        "operation_host_weights": operation_host_weights(device, dtype)}
        except RuntimeError as exc:  # every operation then costs alike, as on a CPU
            peaks.checks.append(f"operation class weights not measured ({exc}): one cost per "
                                "operation")
    # what a replayed call costs the host, and a replayed kernel the device: where an eager fit
    # cannot see them, the starting values (calibrate.fit.MICROBENCHMARKS)
    replay: dict[str, float] = {}
    if cuda:
        try:
            replay["replay_host_s"], replay["replay_kernel_device_s"] = graph_replay_costs(device)
        except RuntimeError as exc:  # a device without graph capture: the priors stay
            peaks.checks.append(f"replay microbenchmark failed ({exc}): priors kept")
    base = HardwareSpec(name=f"{machine_name(device)} ({device}, {dtype}, calibrated)",
                        memory_bandwidth_bytes_per_s=peaks.bandwidth_bytes_per_s,
                        peak_flops_per_s={dtype: peaks.flops_per_s},
                        memory_capacity_bytes=_memory_capacity(device),
                        overhead_overlaps=cuda, cuda_graphs=mode == "graphs",
                        attention_split_by_slot=False, kernels_per_layer=per_layer,
                        attention_kernels_per_slot=0, part_extra_kernels=extras,
                        matmul=peaks.matmul, **by_class, **starting_terms(cuda, replay))

    plan = []
    for role in roles:
        name, model, _ = loaded[role]
        warm_up(model, name, max(grid.positions), max(contexts_for(model, grid)), mode)
        plan += [(role, point) for point in call_grid(model, grid)]
    held_name, held, held_spec = loaded["holdout"]
    depth = held.config.depth
    prompt = [32 + (i * 7) % 90 for i in range(64)]
    tokens = 24 if quick else 48
    drafts = sorted({default_draft_depth(depth), max(1, depth // 4)})
    # held-out runs at a forced acceptance: one (0.85) at both draft depths, or a sweep at the
    # model's default draft depth (what pricing each call from its shape must get right at
    # every acceptance)
    acceptances = acceptances or [DEFAULT_ACCEPTANCE]
    sweep = len(acceptances) > 1
    schedules = [("ar", {}, None)] + [
        (kind, {"draft_depth": d, **({"block_length": 4} if kind == "dtv" else {})}, alpha)
        for alpha in acceptances for kind in ("wfd", "dtv")
        for d in ([default_draft_depth(depth)] if sweep else drafts)]
    # the quick grid measures the runs twice (before and after the passes), the default three times
    run_rounds = 2 if quick else 3
    task = progress.add_task("measuring calls",
                             total=2 * len(plan) + run_rounds * len(schedules)) \
        if progress else None

    def holdout_runs() -> list[ValidationPoint]:
        """Whole runs of the held-out size, per decoded token (forced acceptance)."""
        out = []
        for schedule, kw, alpha in schedules:
            if progress:
                progress.update(task, description=f"{held_name}: {schedule} run {kw}")
            run = quiet.measure(lambda runs: runs[0].wall_s, measure_runs, held_name, held,
                                prompt, tokens, [(schedule, kw)], alpha, mode)[0]
            point = run_point(held_name, held_spec, run, len(prompt), depth)
            if sweep and alpha is not None:
                point = point.model_copy(update={"label": f"{point.label} a={alpha:g}"})
            out.append(point)
            if progress:
                progress.advance(task)
        return out

    # Two passes over the grid, the second in reverse order, keeping each point's faster median:
    # a burst of load rarely hits the same point twice. The runs (seconds long, so more often hit)
    # are measured before, between and after the passes, keeping the fastest; quick: not between.
    run_measurements = [holdout_runs()]
    passes: list[dict[int, CallSample]] = [{}, {}]
    for pass_index, order in enumerate((range(len(plan)), reversed(range(len(plan))))):
        if pass_index and run_rounds == 3:
            run_measurements.append(holdout_runs())
        for i in order:
            role, (kind, n, context, slots) = plan[i]
            name, model, _ = loaded[role]
            if progress:
                progress.update(task, description=f"{name}: {kind} n={n} context={context} "
                                                  f"slots={slots} (pass {pass_index + 1})")
            passes[pass_index][i] = quiet.measure(lambda c: c.median_s, time_call, model,
                                                  name, kind, n, context, slots, grid, mode)
            if progress:
                progress.advance(task)
    samples: list[tuple[str, CallSample]] = [
        (plan[i][0], min(passes[0][i], passes[1][i], key=lambda s: s.median_s))
        for i in range(len(plan))]

    def obs(role: str, s: CallSample) -> Observation:
        return Observation(model=loaded[role][2], record=s.record, seconds=s.median_s)

    def in_training(role: str, s: CallSample) -> bool:
        contexts = contexts_for(loaded[role][1], grid)
        return (role != "holdout" and len(s.record.positions) in TRAIN_POSITIONS
                and min(s.record.positions) in (min(contexts), max(contexts)))

    train = [obs(r, s) for r, s in samples if in_training(r, s)]
    result = fit(base, train, dtype)

    def call_point(i: int) -> ValidationPoint:
        """Grid point i, kept at its faster pass, with both passes' medians."""
        role, s = samples[i]
        return ValidationPoint(
            kind="call", model=s.model, spec=loaded[role][2], group=s.record.kind,
            measured_s=s.median_s, record=s.record,
            repeats_s=[each[i].median_s for each in passes],
            label=f"{s.record.kind} n={len(s.record.positions)} "
                  f"context={min(s.record.positions)} slots={len(s.record.slot_contexts())}")

    points = [call_point(i) for i, (r, s) in enumerate(samples) if not in_training(r, s)]
    run_measurements.append(holdout_runs())
    points += [min(each, key=lambda point: point.measured_s).model_copy(
        update={"repeats_s": [point.measured_s for point in each]})
        for each in zip(*run_measurements, strict=True)]

    fitted = result.coefficients()
    measured = {"peak_bandwidth": (peaks.bandwidth_bytes_per_s, "B/s"),
                "peak_flops": (peaks.flops_per_s, "flop/s"),
                "kernels_per_layer": (per_layer, "operations"),
                **{f"{part}_extra_kernels": (count, "operations")
                   for part, count in extras.items()},
                **{f"host_weight_{kind}": (w, "x an elementwise operation's host time")
                   for kind, w in by_class.get("operation_host_weights", {}).items()},
                **{key: (value, "s") for key, value in replay.items()}}
    if peaks.matmul is not None:
        measured["cache_knee"] = (peaks.cache_bytes, "B")
        measured["reported_cache"] = (peaks.reported_cache_bytes, "B")
    for key, (value, unit) in measured.items():
        fitted[key] = FittedValue(value=value, stderr=0.0, unit=f"{unit} (measured)")
    profile = CalibrationProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        hardware=result.hardware, machine=machine_name(device), device=device,
        torch_version=torch.__version__, dtype=dtype, commit=current_commit(),
        threads=None if device.startswith("cuda") else torch.get_num_threads(),
        models=[n for n, _, _ in loaded.values()],
        grid={"positions": list(grid.positions), "contexts": list(grid.contexts),
              "repeats": [grid.repeats],
              "train_positions": list(TRAIN_POSITIONS),
              "train_models": [loaded[r][0] for r in roles if r != "holdout"]},
        coefficients=fitted, held=result.held(), checks=peaks.checks,
        load=None if cuda else LoadReport(**quiet.report()),
        fit_stats=result.stats(),
        training=[call_point(i) for i, (r, s) in enumerate(samples) if in_training(r, s)],
        validation=points,
    )
    return profile


def _memory_capacity(device: str) -> float:
    import torch

    from wfd.runtime import meminfo_bytes

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    total = meminfo_bytes("MemTotal")
    return float(total) if total is not None else 16e9
