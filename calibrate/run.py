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
from typing import NamedTuple

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
from .fit import MICROBENCHMARKS, FitResult, Observation, fit, prior
from .machine import Peaks, measure_peaks
from .measure import FULL, QUICK, call_grid, contexts_for, measure_runs
from .operations import (
    DecoderOperations,
    decoder_operations,
    graph_replay_costs,
    operation_host_weights,
)
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


class LoadedModel(NamedTuple):
    """A model of the calibration: its name, the model, and the spec the cost model prices it by."""

    name: str
    model: object
    spec: object


def load_models(family: str, checkpoint: str | None, fit_models: list[str] | None,
                holdout_model: str | None, device: str,
                dtype: str) -> dict[str, LoadedModel]:
    """The models by role ("fit0", "fit1", ... and "holdout"), each checked to be of
    ``family``."""
    from wfd.checkpoint import CheckpointError, load_model

    default_fit, default_holdout = default_models(family, checkpoint)
    roles = {f"fit{i}": name for i, name in enumerate(fit_models or default_fit)}
    roles["holdout"] = holdout_model or default_holdout
    loaded = {}
    for role, name in roles.items():
        model = load_model(name, device=device, dtype=dtype)
        if model.config.family != family:
            raise CheckpointError(f"{name} is a {model.config.family} model, not {family}")
        loaded[role] = LoadedModel(name, model, spec_for(name, model))
    return loaded


def machine_peaks(device: str, dtype: str, quiet: Quiet, quick: bool, progress,
                  machine_from: Path | None, force: bool) -> Peaks:
    """The machine's peaks, cache and a CPU's product curve: those of ``machine_from``'s
    profile, else measured."""
    if machine_from is not None:
        return reused_peaks(machine_from, device, dtype, force)
    machine_task = progress.add_task("measuring the machine: bandwidth, flops, matrix "
                                     "products", total=None) if progress else None
    peaks = measure_peaks(device, dtype, quiet, CURVE_ROWS_QUICK if quick else CURVE_ROWS)
    if progress:
        progress.remove_task(machine_task)
    return peaks


def operation_class_fields(ops: DecoderOperations, device: str, dtype: str,
                           checks: list[str]) -> dict:
    """A GPU's operations by class and each class's measured host time, as HardwareSpec fields;
    none where the weights could not be measured (said in ``checks``)."""
    try:
        return {"layer_operations": ops.layer_by_class,
                "part_extra_operations": ops.extras_by_class,
                "operation_host_weights": operation_host_weights(device, dtype)}
    except RuntimeError as exc:  # every operation then costs alike, as on a CPU
        checks.append(f"operation class weights not measured ({exc}): one cost per operation")
        return {}


def replay_costs(device: str, checks: list[str]) -> dict[str, float]:
    """What a replayed call costs a GPU's host, and a replayed kernel the device: where an eager
    fit cannot see them, the starting values (calibrate.fit.MICROBENCHMARKS); none where the
    microbenchmark failed (said in ``checks``)."""
    replay: dict[str, float] = {}
    try:
        replay["replay_host_s"], replay["replay_kernel_device_s"] = graph_replay_costs(device)
    except RuntimeError as exc:  # a device without graph capture: the priors stay
        checks.append(f"replay microbenchmark failed ({exc}): priors kept")
    return replay


def measured_figures(peaks: Peaks, ops: DecoderOperations, by_class: dict,
                     replay: dict[str, float]) -> dict[str, tuple[float, str]]:
    """The figures a calibration measures rather than fits, each with its unit."""
    measured = {"peak_bandwidth": (peaks.bandwidth_bytes_per_s, "B/s"),
                "peak_flops": (peaks.flops_per_s, "flop/s"),
                "kernels_per_layer": (ops.per_layer, "operations"),
                **{f"{part}_extra_kernels": (count, "operations")
                   for part, count in ops.extras.items()},
                **{f"host_weight_{kind}": (w, "x an elementwise operation's host time")
                   for kind, w in by_class.get("operation_host_weights", {}).items()},
                **{key: (value, "s") for key, value in replay.items()}}
    if peaks.matmul is not None:
        measured["cache_knee"] = (peaks.cache_bytes, "B")
        measured["reported_cache"] = (peaks.reported_cache_bytes, "B")
    return measured


def starting_hardware(loaded: dict[str, LoadedModel], peaks: Peaks, device: str, dtype: str,
                      mode: str) -> tuple[HardwareSpec, dict[str, tuple[float, str]]]:
    """(the hardware a fit starts from, the figures measured rather than fitted): the peaks,
    the decoder's operations counted, and on a GPU its operation classes' host times and the
    graph replay's costs, measured (failures said in ``peaks.checks``)."""
    from wfd.runtime import machine_name

    cuda = device.startswith("cuda")
    # Kernels are the decoder's dispatched operations, counted; attention over several KV slots
    # is one of them (a wave is batched), so attention adds no kernels per slot. On a GPU the
    # classes are priced apart: each its measured host time, views no kernel (a CPU's products
    # are in its curve, and its calibration keeps one cost per operation).
    ops = decoder_operations([m.model for role, m in loaded.items() if role != "holdout"])
    by_class = operation_class_fields(ops, device, dtype, peaks.checks) if cuda else {}
    replay = replay_costs(device, peaks.checks) if cuda else {}
    base = HardwareSpec(name=f"{machine_name(device)} ({device}, {dtype}, calibrated)",
                        memory_bandwidth_bytes_per_s=peaks.bandwidth_bytes_per_s,
                        peak_flops_per_s={dtype: peaks.flops_per_s},
                        memory_capacity_bytes=_memory_capacity(device),
                        overhead_overlaps=cuda, cuda_graphs=mode == "graphs",
                        attention_split_by_slot=False, kernels_per_layer=ops.per_layer,
                        attention_kernels_per_slot=0, part_extra_kernels=ops.extras,
                        matmul=peaks.matmul, **by_class, **starting_terms(cuda, replay))
    return base, measured_figures(peaks, ops, by_class, replay)


# a held-out run: its schedule, the schedule's options, and its forced acceptance (None: AR)
Schedule = tuple[str, dict, float | None]


def holdout_schedules(depth: int, acceptances: list[float]) -> list[Schedule]:
    """The held-out runs: AR, and WFD and DtV at a forced acceptance: one (DEFAULT_ACCEPTANCE)
    at both draft depths, or a sweep at the model's default draft depth (what pricing each call
    from its shape must get right at every acceptance)."""
    if len(acceptances) > 1:
        drafts = [default_draft_depth(depth)]
    else:
        drafts = sorted({default_draft_depth(depth), max(1, depth // 4)})
    return [("ar", {}, None)] + [
        (kind, {"draft_depth": d, **({"block_length": 4} if kind == "dtv" else {})}, alpha)
        for alpha in acceptances for kind in ("wfd", "dtv") for d in drafts]


class Measurements:
    """The timed part of a calibration, on one progress line: every model's call grid in two
    passes, and rounds of whole runs of the held-out size around them."""

    def __init__(self, loaded: dict[str, LoadedModel], grid: Grid, mode: str, quiet: Quiet,
                 progress, schedules: list[Schedule], sweep: bool, quick: bool) -> None:
        self.loaded, self.grid, self.mode, self.quiet = loaded, grid, mode, quiet
        self.progress, self.schedules, self.sweep = progress, schedules, sweep
        self.plan: list[tuple[str, tuple[str, int, int, int]]] = []  # (role, call) to time
        for role, (name, model, _) in loaded.items():
            warm_up(model, name, max(grid.positions), max(contexts_for(model, grid)), mode)
            self.plan += [(role, point) for point in call_grid(model, grid)]
        self.prompt = [32 + (i * 7) % 90 for i in range(64)]
        self.tokens = 24 if quick else 48
        # the quick grid measures the runs twice (before and after the passes), the default
        # three times
        self.run_rounds = 2 if quick else 3
        total = 2 * len(self.plan) + self.run_rounds * len(schedules)
        self.task = progress.add_task("measuring calls", total=total) if progress else None
        self.run_measurements: list[list[ValidationPoint]] = []  # each round of the runs
        self.passes: list[dict[int, CallSample]] = [{}, {}]  # each pass's sample by plan index
        self.samples: list[tuple[str, CallSample]] = []  # (role, faster pass) by plan index

    def _starting(self, description: str) -> None:
        if self.progress:
            self.progress.update(self.task, description=description)

    def _done(self) -> None:
        if self.progress:
            self.progress.advance(self.task)

    def holdout_runs(self) -> None:
        """A round of whole runs of the held-out size, per decoded token (forced acceptance)."""
        name, held, spec = self.loaded["holdout"]
        out = []
        for schedule, kw, alpha in self.schedules:
            self._starting(f"{name}: {schedule} run {kw}")
            run = self.quiet.measure(lambda runs: runs[0].wall_s, measure_runs, name, held,
                                     self.prompt, self.tokens, [(schedule, kw)], alpha,
                                     self.mode)[0]
            point = run_point(name, spec, run, len(self.prompt), held.config.depth)
            if self.sweep and alpha is not None:
                point = point.model_copy(update={"label": f"{point.label} a={alpha:g}"})
            out.append(point)
            self._done()
        self.run_measurements.append(out)

    def time_grid_point(self, i: int, pass_index: int) -> CallSample:
        """Grid point i's call, timed in pass ``pass_index``."""
        role, (kind, n, context, slots) = self.plan[i]
        name, model, _ = self.loaded[role]
        self._starting(f"{name}: {kind} n={n} context={context} slots={slots} "
                       f"(pass {pass_index + 1})")
        sample = self.quiet.measure(lambda c: c.median_s, time_call, model, name, kind, n,
                                    context, slots, self.grid, self.mode)
        self._done()
        return sample

    def measure_grid(self) -> None:
        """Two passes over the grid, the second in reverse order, keeping each point's faster
        median: a burst of load rarely hits the same point twice. The runs (seconds long, so
        more often hit) are measured before, between and after the passes (``final_runs``),
        keeping the fastest; quick: not between."""
        self.holdout_runs()
        for pass_index, order in enumerate((range(len(self.plan)),
                                            reversed(range(len(self.plan))))):
            if pass_index and self.run_rounds == 3:
                self.holdout_runs()
            for i in order:
                self.passes[pass_index][i] = self.time_grid_point(i, pass_index)
        self.samples = [
            (self.plan[i][0], min(self.passes[0][i], self.passes[1][i], key=lambda s: s.median_s))
            for i in range(len(self.plan))]

    def final_runs(self) -> list[ValidationPoint]:
        """The last round of runs, then each run at its fastest round, with every round's
        time."""
        self.holdout_runs()
        return [min(each, key=lambda point: point.measured_s).model_copy(
            update={"repeats_s": [point.measured_s for point in each]})
            for each in zip(*self.run_measurements, strict=True)]

    def in_training(self, i: int) -> bool:
        """Whether grid point i is fitted: a fitted model's call at ``TRAIN_POSITIONS``
        positions and at the shortest or longest context of the grid."""
        role, s = self.samples[i]
        contexts = contexts_for(self.loaded[role].model, self.grid)
        return (role != "holdout" and len(s.record.positions) in TRAIN_POSITIONS
                and min(s.record.positions) in (min(contexts), max(contexts)))

    def observations(self) -> list[Observation]:
        """The fitted calls, as the fit takes them."""
        return [Observation(model=self.loaded[role].spec, record=s.record, seconds=s.median_s)
                for i, (role, s) in enumerate(self.samples) if self.in_training(i)]

    def call_points(self, training: bool) -> list[ValidationPoint]:
        """The fitted calls (``training``) or the held-out ones, each kept at its faster pass,
        with both passes' medians."""
        points = []
        for i, (role, s) in enumerate(self.samples):
            if self.in_training(i) != training:
                continue
            points.append(ValidationPoint(
                kind="call", model=s.model, spec=self.loaded[role].spec, group=s.record.kind,
                measured_s=s.median_s, record=s.record,
                repeats_s=[each[i].median_s for each in self.passes],
                label=f"{s.record.kind} n={len(s.record.positions)} "
                      f"context={min(s.record.positions)} "
                      f"slots={len(s.record.slot_contexts())}"))
        return points


def calibration_profile(result: FitResult, measured: dict[str, tuple[float, str]],
                        checks: list[str], measurements: Measurements,
                        validation: list[ValidationPoint], device: str,
                        dtype: str) -> CalibrationProfile:
    """The profile of a fit: its hardware and coefficients, the figures measured rather than
    fitted among them, and the calls and runs it was fitted on and validated with."""
    import torch

    from wfd.runtime import machine_name

    fitted = result.coefficients()
    for key, (value, unit) in measured.items():
        fitted[key] = FittedValue(value=value, stderr=0.0, unit=f"{unit} (measured)")
    cuda = device.startswith("cuda")
    loaded, grid = measurements.loaded, measurements.grid
    return CalibrationProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        hardware=result.hardware, machine=machine_name(device), device=device,
        torch_version=torch.__version__, dtype=dtype, commit=current_commit(),
        threads=None if cuda else torch.get_num_threads(),
        models=[m.name for m in loaded.values()],
        grid={"positions": list(grid.positions), "contexts": list(grid.contexts),
              "repeats": [grid.repeats],
              "train_positions": list(TRAIN_POSITIONS),
              "train_models": [m.name for role, m in loaded.items() if role != "holdout"]},
        coefficients=fitted, held=result.held(), checks=checks,
        load=None if cuda else LoadReport(**measurements.quiet.report()),
        fit_stats=result.stats(),
        training=measurements.call_points(training=True),
        validation=validation,
    )


def calibrate(family: str, *, checkpoint: str | None = None, device: str = "cpu",
              dtype: str = "fp32", quick: bool = False, threads: int | None = None,
              fit_models: list[str] | None = None, holdout_model: str | None = None,
              mode: str = "eager", progress=None, machine_from: Path | None = None,
              force: bool = False, acceptances: list[float] | None = None,
              retries: int | None = None) -> CalibrationProfile:
    import torch

    if threads:
        torch.set_num_threads(threads)
    grid: Grid = QUICK if quick else FULL
    # the models first: a wrong checkpoint fails before a minute of measuring
    loaded = load_models(family, checkpoint, fit_models, holdout_model, device, dtype)
    cuda = device.startswith("cuda")
    # a GPU is not shared: a slow canary there is launch jitter, not load, and is not retried
    quiet = Quiet(device, retries=(0 if cuda else 4) if retries is None else retries,
                  budget_s=60.0 if quick else 120.0)
    peaks = machine_peaks(device, dtype, quiet, quick, progress, machine_from, force)
    base, measured = starting_hardware(loaded, peaks, device, dtype, mode)
    acceptances = acceptances or [DEFAULT_ACCEPTANCE]
    schedules = holdout_schedules(loaded["holdout"].model.config.depth, acceptances)
    measurements = Measurements(loaded, grid, mode, quiet, progress, schedules,
                                sweep=len(acceptances) > 1, quick=quick)
    measurements.measure_grid()
    result = fit(base, measurements.observations(), dtype)
    validation = measurements.call_points(training=False) + measurements.final_runs()
    return calibration_profile(result, measured, peaks.checks, measurements, validation,
                               device, dtype)


def _memory_capacity(device: str) -> float:
    import torch

    from wfd.runtime import meminfo_bytes

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    total = meminfo_bytes("MemTotal")
    return float(total) if total is not None else 16e9
