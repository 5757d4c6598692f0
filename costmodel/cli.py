"""`costmodel` command line. Starts fast: no torch, scipy or matplotlib on this path."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated

import typer

from .clitools import UserError, error_summary, print_json, run, spinner, text_table
from .engines import ENGINES, VLLM_SOURCE, for_engine
from .errors import ProfileError, TraceError
from .figures import NO_PLOTS
from .memory import does_not_fit
from .predict import Prediction, predict
from .presets import UnknownPresetError, get_hardware, get_model
from .specs import EAGER_HOST_SOURCE, HardwareSpec, Workload
from .units import (
    UnitError,
    format_bytes,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)

# Options that several commands share.
ModelOption = Annotated[str, typer.Option("--model", help="model preset")]
HardwareOption = Annotated[str, typer.Option("--hardware", help="hardware preset")]
ProfileOption = Annotated[Path | None, typer.Option(
    "--profile", help="calibration profile (JSON): its fitted hardware replaces --hardware")]
ContextOption = Annotated[int, typer.Option("--context", help="prompt/context length in tokens")]
NewTokensOption = Annotated[int, typer.Option("--new-tokens", help="tokens to generate")]
BatchOption = Annotated[int, typer.Option("--batch", help="sequences decoded together")]
DtypeOption = Annotated[str | None, typer.Option(
    "--dtype", help="fp32, bf16, fp16 (default: bf16, or the profile's)")]
JsonOption = Annotated[bool, typer.Option("--json", help="print one JSON object")]


def load_profile(path: Path):
    """costmodel.profile.load_profile, imported when a command reads a profile (a plain predict
    starts without the profile and trace models)."""
    from .profile import load_profile as load

    return load(path)


def save_profile(profile, path: Path) -> None:
    from .profile import save_profile as save

    save(profile, path)


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Predict and explain the decoding speed of looped language models.")


@app.callback()
def _root() -> None:
    """Cost model of AR, draft-then-verify (DtV) and WaveFront Decoding (WFD)."""



def _override(hw: HardwareSpec, bandwidth: str | None, flops: str | None, memory: str | None,
              launch_overhead: str | None, dtype: str, mode: str | None = None,
              host_speed: float | None = None) -> HardwareSpec:
    changes: dict[str, object] = {}
    if bandwidth is not None:
        changes["memory_bandwidth_bytes_per_s"] = parse_bandwidth(bandwidth)
    if flops is not None:
        changes["peak_flops_per_s"] = {**hw.peak_flops_per_s, dtype: parse_flops(flops)}
    if memory is not None:
        changes["memory_capacity_bytes"] = parse_bytes(memory)
    if launch_overhead is not None:
        changes["launch_overhead_s"] = parse_duration(launch_overhead)
    if mode is not None:
        if mode not in ("eager", "graphs"):
            raise UserError(f"unknown mode {mode!r}; use eager or graphs")
        changes["cuda_graphs"] = mode == "graphs"
    if host_speed is not None and not host_speed > 0:
        raise UserError(f"host speed must be a positive factor, got {host_speed}")
    if changes or host_speed is not None:
        changes["name"] = f"{hw.name}*"  # the star marks a preset with overridden figures
    hw = hw.model_copy(update=changes)
    # the host's share of a call runs host_speed times faster; the device's terms are untouched
    return hw.with_host_speed(host_speed) if host_speed is not None else hw



def _at_least_one(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise UserError(f"{name.replace('_', ' ')} must be at least 1, got {value}")


def _hardware(profile: Path | None, hardware: str, dtype: str | None):
    """(the profile or None, its fitted hardware or the preset, the dtype: given, the
    profile's, or bf16)."""
    prof = load_profile(profile) if profile is not None else None
    if prof is not None:
        _note_machine(prof, profile)
    dtype = dtype or (prof.dtype if prof is not None else "bf16")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise UserError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    return prof, prof.hardware if prof is not None else get_hardware(hardware), dtype


def _flops_text(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.0f} TFLOPS" if flops_per_s >= 1e12 else \
        f"{flops_per_s / 1e9:.0f} GFLOPS"

def _print_table(p: Prediction) -> None:
    wl, hw, mem = p.workload, p.hardware, p.memory
    alpha = next((r.acceptance for r in p.schedules.values() if r.acceptance is not None), None)
    typer.echo(
        f"{p.model} on {hw.name} ({hw.memory_bandwidth_bytes_per_s / 1e9:.0f} "
        f"GB/s, {_flops_text(hw.peak_flops_per_s.get(wl.dtype, 0))} {wl.dtype}, "
        f"{format_bytes(hw.memory_capacity_bytes)}), R = {p.depth}, context {wl.context_length}"
        f" + {wl.new_tokens} new, batch {wl.batch_size}"
        + (f" (a run of {wl.prompts} prompts to its end), " if wl.prompts
           else " (steady state), " if wl.batch_size > 1 else ", ")
        + ("recurrence-specific KV" if wl.kv_sharing == 0 else f"KV shared over "
           f"{wl.kv_sharing} slot(s)")
        + (f", acceptance {alpha:.2f}" if alpha is not None else "")
        + (", CUDA graphs" if hw.cuda_graphs else "")
        + (f", exits at mean depth {p.schedules['ar'].mean_exit_depth:.2f} (WFD simulated)"
           if "ar" in p.schedules and p.schedules["ar"].mean_exit_depth is not None else ""))
    fit = "fits" if mem.fits else "DOES NOT FIT"
    typer.echo(
        f"memory: {fit}: weights {format_bytes(mem.weights_bytes)} + KV "
        f"{format_bytes(mem.kv_bytes)} + activations {format_bytes(mem.activation_bytes)} = "
        f"{format_bytes(mem.total_bytes)} of {format_bytes(mem.capacity_bytes)}; the longest "
        f"sequence that fits is {mem.max_context:,} tokens"
        + (f", the largest batch of this length {mem.max_batch:,}" if wl.batch_size > 1 else ""))
    if not mem.fits:
        return
    rows = []
    for key, r in p.schedules.items():
        label = {"ar": "AR", "dtv": f"DtV k={r.block_length} d={r.draft_depth}",
                 "wfd": f"WFD d={r.draft_depth} W={r.width}"}[key]
        b = r.breakdown
        rows.append([label, f"{r.latency_per_token_s * 1e3:.2f}", f"{r.tokens_per_s:.1f}",
                     f"{r.speedup_vs_ar:.2f}x", f"{r.block_calls_per_token:.2f}",
                     *(f"{t * 1e3:.2f}" for t in (b.weights_s, b.kv_s, b.compute_s,
                                                   b.overhead_s)),
                     f"{r.roofline_fraction:.0%}", r.bound])
    typer.echo(text_table(["schedule", "ms/token", "tokens/s", "speedup", "B calls/token",
                           "weights ms", "KV ms", "compute ms", "overhead ms", "roofline",
                           "bound"], rows, left=(0, 10)))


def _exit_options(rule: str | None, min_depth: int, exit_depths: str | None, depth: int
                  ) -> dict[str, object]:
    """The adaptive-depth fields of a workload, checked (one line for a bad one)."""
    from .exits import ExitRule, parse_exit_depths

    out: dict[str, object] = {}
    if rule is not None:
        ExitRule.parse(rule, min_depth).for_plan(False, depth)  # ValueError: a UserError
        out.update(exit_rule=rule, exit_min_depth=min_depth)
    elif min_depth != 1:
        raise UserError("--min-depth goes with --exit")
    if exit_depths is not None:
        out["exit_depths"] = parse_exit_depths(exit_depths, depth)
    return out


@app.command("predict")
def predict_cmd(
    model: ModelOption = "huginn-3.5b",
    hardware: HardwareOption = "a6000",
    profile: ProfileOption = None,
    bandwidth: Annotated[str | None, typer.Option(help="memory bandwidth, e.g. 768GB/s")] = None,
    flops: Annotated[str | None, typer.Option(help="peak matrix flops, e.g. 155TFLOPS")] = None,
    memory: Annotated[str | None, typer.Option(help="memory capacity, e.g. 48GB, 48GiB")] = None,
    launch_overhead: Annotated[str | None, typer.Option(
        help="per-kernel launch overhead, e.g. 5us")] = None,
    width: Annotated[int | None, typer.Option(
        help="WFD width W (draft depth ceil(R/W))")] = None,
    draft_depth: Annotated[int | None, typer.Option(help="draft depth d (< R)")] = None,
    block_length: Annotated[int | None, typer.Option(
        help="DtV block length k (default: the best in 1..32)")] = None,
    acceptance: Annotated[float | None, typer.Option(
        help="draft acceptance alpha in [0, 1] (default: the model's)")] = None,
    depth_trace: Annotated[Path | None, typer.Option(
        help="a measured depth trace: the acceptance at the draft depth is read from it")] = None,
    context: ContextOption = 1024,
    new_tokens: NewTokensOption = 512,
    depth: Annotated[int | None, typer.Option(help="recurrence depth R (default: model's)")] = None,
    kv_sharing: Annotated[int, typer.Option(
        help="0: one KV slot per depth; S >= 1: S shared slots")] = 0,
    exit_rule: Annotated[str | None, typer.Option(
        "--exit", help="adaptive depth: RULE[:THRESHOLD] (kl, entropy-diff, latent-diff, "
        "argmax-stable, gate); the exit depths are read from --depth-trace under it")] = None,
    min_depth: Annotated[int, typer.Option(
        help="--exit: the shallowest depth a token may stop at")] = 1,
    exit_depths: Annotated[str | None, typer.Option(
        help="adaptive depth: the exit depths' distribution, e.g. \"4:0.3,6:0.5,8:0.2\" "
             "(--acceptance: of the drafts of tokens that go past the draft depth)")] = None,
    batch: BatchOption = 1,
    prompts: Annotated[int | None, typer.Option(
        help="a run of N prompts decoded --batch at a time, to its end (the batch empties as "
             "its last sequences finish), simulated call by call; default: the steady state of "
             "a full batch")] = None,
    dtype: DtypeOption = None,
    mode: Annotated[str | None, typer.Option(
        help="eager (kernels launched one by one) or graphs (replayed from CUDA graphs); "
             "default: the profile's or preset's")] = None,
    host_speed: Annotated[float | None, typer.Option(
        help="a host X times faster: per-call, per-layer and per-kernel host overheads / X")
    ] = None,
    engine: Annotated[str, typer.Option(
        help="wfd (this decoder) or vllm (vLLM's AR: CUDA graphs and its kernel counts; DtV "
             "and WFD as they would run inside it)")] = "wfd",
    as_json: JsonOption = False,
) -> None:
    """Per-token latency, speedup and its breakdown for AR, DtV and WFD."""
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise UserError(f"acceptance must be in [0, 1], got {acceptance}")
    _at_least_one(context=context, new_tokens=new_tokens, batch=batch, prompts=prompts)
    if kv_sharing < 0:
        raise UserError(f"KV sharing must be 0 (per-depth slots) or a slot count >= 1, "
                        f"got {kv_sharing}")
    if depth is not None and depth < 2:
        raise UserError(f"depth R must be at least 2, got {depth}")
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; use {' or '.join(ENGINES)}")
    prof, base, dtype = _hardware(profile, hardware, dtype)
    spec = get_model(model)
    base = for_engine(engine, base, spec)
    hw = _override(base, bandwidth, flops, memory, launch_overhead, dtype, mode, host_speed)
    exits = _exit_options(exit_rule, min_depth, exit_depths, depth or spec.default_depth)
    if exit_rule is not None and exit_depths is None and depth_trace is None:
        raise UserError("--exit is priced from the exit depths a --depth-trace gives under it "
                        "(or give their distribution: --exit-depths)")
    workload = Workload(context_length=context, new_tokens=new_tokens, acceptance=acceptance,
                        depth_trace=str(depth_trace) if depth_trace else None,
                        batch_size=batch, dtype=dtype, kv_sharing=kv_sharing, depth=depth,
                        prompts=prompts, **exits)
    # a run of prompts is simulated call by call: seconds, where the closed forms take a blink
    with spinner(f"simulating {prompts} prompts x {new_tokens} tokens, batch {batch}, for AR, "
                 "DtV and WFD", disable=as_json or prompts is None):
        result = predict(spec, hw, workload, width=width, draft_depth=draft_depth,
                         block_length=block_length)
    loose = _undetermined(prof) if prof is not None else []
    host = _host_source(result.hardware, launch_overhead, host_speed)
    if engine == "vllm":
        host = VLLM_SOURCE
    if as_json:
        payload = result.model_dump(mode="json")
        payload["host_source"] = host
        payload["engine"] = engine
        payload["hardware"] = result.hardware.name
        payload["hardware_spec"] = result.hardware.model_dump(mode="json")
        payload["mode"] = "graphs" if result.hardware.cuda_graphs else "eager"
        payload["host_speed"] = host_speed or 1.0
        payload["profile_undetermined"] = loose
        print_json(payload)
    else:
        _print_table(result)
        _note_undetermined(loose)
        if host is not None:
            typer.echo(f"note: {'engine' if engine == 'vllm' else 'host'}: {host}", err=True)
    if not result.memory.fits:
        typer.echo(f"error: {does_not_fit(result.memory, workload)}", err=True)
        raise typer.Exit(1)


@app.command("recommend")
def recommend_cmd(
    model: ModelOption = "huginn-3.5b",
    hardware: HardwareOption = "a6000",
    profile: ProfileOption = None,
    depth_trace: Annotated[Path | None, typer.Option(
        help="a depth trace (wfd generate --depth-trace): the acceptance of every depth")] = None,
    acceptance_by_depth: Annotated[str | None, typer.Option(
        help="the acceptance at each draft depth, e.g. 1:0.6,2:0.8,4:0.93")] = None,
    context: ContextOption = 1024,
    new_tokens: NewTokensOption = 512,
    batch: BatchOption = 1,
    dtype: DtypeOption = None,
    top: Annotated[int, typer.Option(help="configurations to list")] = 5,
    as_json: JsonOption = False,
) -> None:
    """The fastest schedules and their parameters for a model, hardware and acceptance curve,
    with the `wfd generate` flags that run each."""
    from .recommend import parse_acceptance_by_depth, recommend
    from .trace import read_depth_trace

    if (depth_trace is None) == (acceptance_by_depth is None):
        raise UserError("give exactly one of --depth-trace and --acceptance-by-depth")
    _at_least_one(context=context, new_tokens=new_tokens, batch=batch, top=top)
    spec = get_model(model)
    if depth_trace is not None:
        trace = read_depth_trace(depth_trace)
        if trace.header.depth != spec.default_depth:
            raise UserError(f"the depth trace was recorded at R = {trace.header.depth} "
                            f"({trace.header.model}); {model} runs at R = {spec.default_depth}")
        acceptance = trace.acceptance_by_depth()
    else:
        acceptance = parse_acceptance_by_depth(acceptance_by_depth)
    _, hw, dtype = _hardware(profile, hardware, dtype)
    workload = Workload(context_length=context, new_tokens=new_tokens, batch_size=batch,
                        dtype=dtype)
    choices = recommend(spec, hw, acceptance, workload, top=top)
    if as_json:
        print_json({"model": spec.name, "hardware": hw.name, "workload": workload.model_dump(),
                    "acceptance_by_depth": acceptance,
                    "choices": [{**c.model_dump(), "label": c.label, "flags": c.flags}
                                for c in choices]})
        return
    rows = [[str(rank), c.label, "" if c.acceptance is None else f"{c.acceptance:.2f}",
             f"{c.tokens_per_s:.1f}", f"{c.speedup_vs_ar:.2f}x", c.bound, c.flags]
            for rank, c in enumerate(choices, 1)]
    typer.echo(text_table(["rank", "configuration", "acceptance", "tokens/s", "speedup",
                           "bound", "wfd generate flags"], rows, left=(1, 5, 6),
                          title=f"{spec.name} on {hw.name}, context {context}, batch {batch}"))


@app.command("study")
def study_cmd(
    name: Annotated[str, typer.Argument(help="study name, or 'list'")],
    profile: Annotated[Path | None, typer.Option(
        help="calibration profile whose hardware the study uses")] = None,
    out: Annotated[Path, typer.Option(help="folder for the table and figure")] = Path(
        "out/studies"),
    as_json: JsonOption = False,
) -> None:
    """Run a design-space study: writes NAME.csv, NAME.md and NAME.png into --out."""
    import studies

    if name == "list":
        typer.echo("\n".join(studies.STUDIES))
        return
    if name not in studies.STUDIES:
        raise UserError(f"unknown study {name!r}; known: {', '.join(studies.STUDIES)}")
    prof = load_profile(profile) if profile is not None else None
    if prof is not None:
        _note_machine(prof, profile)
    hw = prof.hardware if prof is not None else None
    loose = _undetermined(prof) if prof is not None else []
    with spinner(f"study {name}", disable=as_json):
        result, paths = studies.run(name, profile=hw, out=out)
    if as_json:
        print_json({"name": name, "outputs": paths, "rows": result.rows, **result.summary,
                    "profile_undetermined": loose})
        return
    from .studies_view import print_study

    print_study(result, paths)
    if "figure" not in paths:
        typer.echo(NO_PLOTS, err=True)
    _note_undetermined(loose)


@app.command("calibrate")
def calibrate_cmd(
    model: Annotated[str, typer.Option(help="family: huginn or ouro")],
    checkpoint: Annotated[Path | None, typer.Option(
        help="a checkpoint folder of that family (default: the shipped tiny model)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16")] = "fp32",
    quick: Annotated[bool, typer.Option(help="a small grid (about 7 minutes on a CPU)")] = False,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: torch's)")] = None,
    fit_models: Annotated[str | None, typer.Option(
        help="comma-separated models to fit on (default: the tiny model, FAMILY-small:random "
             "and FAMILY-mid:random)")] = None,
    holdout_model: Annotated[str | None, typer.Option(
        help="model size held out for validation (default: FAMILY-base:random)")] = None,
    mode: Annotated[str, typer.Option(
        help="the decoder's execution mode to measure: eager, or graphs (CUDA graphs, --device "
             "cuda only)")] = "eager",
    out: Annotated[Path | None, typer.Option(help="profile file to write")] = None,
    force: Annotated[bool, typer.Option(
        help="write the profile even when the machine was too busy to trust it (flagged), or "
             "with --machine-from another machine's measurements")] = False,
    machine_from: Annotated[Path | None, typer.Option(
        help="reuse the machine measurements (peaks, cache, product curve) of an earlier "
             "profile of this machine instead of measuring them again")] = None,
    acceptances: Annotated[str | None, typer.Option(
        help="the held-out DtV and WFD runs' forced acceptances, comma-separated, e.g. "
             "0.6,0.75,0.9 (default: 0.85 at two draft depths; a sweep runs the default "
             "draft depth at each)")] = None,
    as_json: JsonOption = False,
) -> None:
    """Measure the decoder on this machine, fit the cost model, validate on held-out points and
    save a versioned profile."""
    if mode not in ("eager", "graphs"):
        raise UserError(f"unknown mode {mode!r}; use eager or graphs")
    if mode == "graphs" and not device.startswith("cuda"):
        raise UserError("--mode graphs captures CUDA graphs: it needs --device cuda")
    if model not in ("huginn", "ouro"):
        raise UserError(f"unknown model family {model!r}; use huginn or ouro")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise UserError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    if device != "cpu" and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}; use cpu or cuda")
    if checkpoint is not None and not checkpoint.is_dir():
        raise UserError(f"checkpoint {checkpoint} is not a folder")
    alphas = parse_acceptances(acceptances) if acceptances is not None else None
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} is not available (torch sees no CUDA device)")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from calibrate.run import calibrate, too_busy
    from calibrate.validate import report
    from wfd.checkpoint import CheckpointError

    out = out or Path(f"out/profile-{model}-{device.split(':')[0]}-{dtype}.json")
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      transient=True, disable=as_json) as progress:
            profile = calibrate(model, checkpoint=str(checkpoint) if checkpoint else None,
                                device=device, dtype=dtype, quick=quick, threads=threads,
                                fit_models=fit_models.split(",") if fit_models else None,
                                holdout_model=holdout_model, mode=mode, progress=progress,
                                machine_from=machine_from, force=force, acceptances=alphas)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    busy = too_busy(profile.load)
    if busy and not force:
        raise UserError(f"no profile written: {busy}")
    if busy:
        profile.load.forced = True
    save_profile(profile, out)
    rep = report(profile.validation, profile.hardware, profile.dtype)
    plot_path = out.with_suffix(".png")
    _print_validation(profile, rep, out, _plot(rep, plot_path, profile.hardware.name), as_json)


def parse_acceptances(text: str) -> list[float]:
    """Comma-separated acceptances, each in (0, 1]."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--acceptances takes comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise UserError(f"an acceptance must be in (0, 1], got {bad[0]:g}")
    return list(dict.fromkeys(values))


def _plot(rep, path: Path, title: str) -> Path | None:
    from calibrate.validate import plot

    if plot(rep, path, title):
        return path
    typer.echo(NO_PLOTS, err=True)
    return None


def _host_source(hw: HardwareSpec, launch_overhead: str | None, host_speed: float | None
                 ) -> str | None:
    """Where a preset's host terms come from (None: a profile's, calibrated with its counts)."""
    if hw.kernels_per_layer is not None:
        return None
    if launch_overhead is None:
        source = EAGER_HOST_SOURCE
    else:
        source = (f"{launch_overhead} per dispatched operation (--launch-overhead) x this "
                  "decoder's operations per call (costmodel/data/operations.json)")
    return source + (f", / {host_speed:g} (--host-speed)" if host_speed is not None else "")


def _undetermined(profile) -> list[str]:
    """The coefficients the profile holds at priors (its calls did not determine them)."""
    return sorted(name for name, held in profile.held.items() if held.prior)


def _note_undetermined(loose: list[str]) -> None:
    # e.g. an eager decoder on a GPU: the host hid the device, so bandwidth and flops are
    # priors, and the terms they price are not calibrated
    if loose:
        typer.echo(f"note: the profile holds {', '.join(loose)} at priors (its calls do not "
                   "determine them): the terms they price are not calibrated", err=True)


def _note_machine(profile, path: Path) -> None:
    """A CPU profile carried to another machine predicts the machine it was measured on."""
    from .profile import cpu_machine_name

    here = cpu_machine_name()
    if profile.device == "cpu" and profile.machine != here:
        typer.echo(f"note: profile {path} was measured on {profile.machine!r}, not this machine "
                   f"({here!r}): it predicts that one; calibrate here with `costmodel calibrate`",
                   err=True)


def _print_validation(profile, rep, path: Path, plot_path: Path | None, as_json: bool) -> None:
    coefficients = profile.coefficients
    if as_json:
        print_json({"profile": str(path), "plot": str(plot_path) if plot_path else None,
                    "machine": profile.machine,
                    "coefficients": {k: v.model_dump() for k, v in coefficients.items()},
                    "held": {k: v.model_dump() for k, v in profile.held.items()},
                    "checks": profile.checks,
                    "load": profile.load.model_dump() if profile.load else None,
                    "fit_stats": profile.fit_stats, **rep.model_dump(),
                    "cross_mode": [c.model_dump() for c in profile.cross_mode]})
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    threads = f", {profile.threads} threads" if profile.threads else ""
    coef = Table(title=f"fitted on {profile.machine} ({profile.device}, {profile.dtype}{threads})",
                 header_style="bold")
    for col in ("coefficient", "value", "std. error", "unit"):
        coef.add_column(col)
    for name, v in coefficients.items():
        coef.add_row(name, f"{v.value:.4g}", "measured" if v.unit.endswith("(measured)")
                     else f"{v.stderr:.2g}", v.unit.removesuffix(" (measured)"))
    for name, v in profile.held.items():
        coef.add_row(name, f"{v.value:.4g}", "-", v.reason)
    console.print(coef)
    for check in profile.checks:
        console.print(f"checked: {check}")
    if profile.load is not None:
        load = profile.load
        console.print(f"load: {load.measurements} measurements, {load.retaken_fraction:.0%} "
                      f"taken again, {load.loaded_fraction:.0%} kept with the canary over "
                      f"{load.canary_tolerance}x (median {load.canary_median:.2f}x, 90th "
                      f"percentile {load.canary_p90:.2f}x"
                      + (f", spread {load.canary_p90 / load.canary_p10:.2f}x: 90th over 10th"
                         if load.canary_p10 else "") + ")"
                      + (": written with --force, too busy to trust" if load.forced else ""))
    table = Table(title="held-out validation", header_style="bold")
    for col in ("group", "points", "median |rel. error|", "max |rel. error|"):
        table.add_column(col)
    for group, stats in rep.per_schedule.items():
        table.add_row(group, str(int(stats["points"])), f"{stats['median_rel_error']:.1%}",
                      f"{stats['max_rel_error']:.1%}")
    table.add_row("all", str(len(rep.points)), f"{rep.median_rel_error:.1%}",
                  f"{rep.max_rel_error:.1%}")
    from calibrate.validate import FIGURE_POINTS, FIGURES

    # the calibration targets' two figures: per call, and per decoded token of the runs
    for figure, _ in FIGURES:
        if stats := getattr(rep, figure):
            label = FIGURE_POINTS[figure] + (", per token" if figure == "per_token" else "")
            table.add_row(label, str(int(stats["points"])), f"{stats['median_rel_error']:.1%}",
                          f"{stats['max_rel_error']:.1%}")
    console.print(table)
    spreads = [(FIGURE_POINTS[figure], s) for figure, _ in FIGURES
               if (s := rep.repeat_spread.get(figure))]
    if spreads:
        console.print("each held-out point measured again: its slowest over its fastest "
                      "measurement, less 1, is " + " and ".join(
                          f"{s['median_spread']:.1%} for the {what} (median; max "
                          f"{s['max_spread']:.1%})" for what, s in spreads)
                      + ". Errors near these are the machine's noise in that hour, not the "
                      "model's.")

    def cells(*figures) -> list[str]:
        return [f"{f['median_rel_error']:.1%} / {f['max_rel_error']:.1%}" if f else "-"
                for f in figures]

    if rep.per_mode or profile.cross_mode:
        modes = Table(title="by execution mode (median / max |rel. error|)", header_style="bold")
        for col in ("fitted on", "priced", "calls", "runs, per token"):
            modes.add_column(col)
        for mode, stats in rep.per_mode.items():
            modes.add_row("both", mode, *cells(stats["per_call"], stats["per_token"]))
        for check in profile.cross_mode:
            modes.add_row(f"{check.fit_on} only", check.predicted,
                          *cells(check.per_call, check.per_token))
        console.print(modes)
    console.print(f"profile: {path}" + (f"; plot: {plot_path}" if plot_path else ""))


@app.command("validate")
def validate_cmd(
    profile: Annotated[Path, typer.Option(help="calibration profile (JSON)")],
    plot_file: Annotated[Path | None, typer.Option(
        "--plot", help="measured-vs-predicted plot (default: beside the profile)")] = None,
    as_json: JsonOption = False,
) -> None:
    """Re-price the profile's held-out points with its fitted hardware: median and max relative
    error per schedule, and a measured-vs-predicted plot."""
    from calibrate.validate import report

    prof = load_profile(profile)
    if not prof.validation:
        raise UserError(f"profile {profile} holds no validation points")
    rep = report(prof.validation, prof.hardware, prof.dtype)
    plot_path = plot_file or profile.with_suffix(".png")
    _print_validation(prof, rep, profile, _plot(rep, plot_path, prof.hardware.name), as_json)


@app.command("check-profile")
def check_profile_cmd(
    profile: Annotated[Path, typer.Option(help="calibration profile (JSON)")],
    calls: Annotated[int, typer.Option(
        help="how many of the profile's calls to time again (spread over its models)")] = 16,
    as_json: JsonOption = False,
) -> None:
    """Time a sample of the profile's calls on this machine and compare them with the times it
    stored: does it still price this machine? Exit 1 when it does not (recalibrate)."""
    prof = load_profile(profile)
    if calls < 1:
        raise UserError(f"--calls must be at least 1, got {calls}")
    if prof.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"profile {profile} was measured on {prof.device} "
                            f"({prof.machine}); this machine has no CUDA device")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from calibrate.check import call_points, check_profile
    from wfd.checkpoint import CheckpointError

    points = call_points(prof)
    if not points:
        raise UserError(f"profile {profile} holds no calls to time again")
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      transient=True, disable=as_json) as progress:
            check = check_profile(prof, calls, progress)
    except CheckpointError as exc:
        raise UserError(f"profile {profile}: {exc}") from None
    ratio, per_model = check.median_ratio, check.per_model()
    if as_json:
        print_json({"profile": str(profile), **check.model_dump(), "median_ratio": ratio,
                    "holds": check.holds,
                    "per_model": {m: statistics.median(r) for m, r in per_model.items()},
                    "ratios": [c.ratio for c in check.calls]})
    else:
        from rich.console import Console
        from rich.table import Table

        threads = f", {check.threads} threads" if check.threads else ""
        table = Table(title=f"{profile} ({prof.created[:10]}, {check.profile_machine}) "
                            f"on this machine ({check.machine}{threads})", header_style="bold")
        for col in ("model", "calls", "time now / profile's (median)", "range"):
            table.add_column(col)
        for model, ratios in [*per_model.items(), ("all", [c.ratio for c in check.calls])]:
            table.add_row(model, str(len(ratios)), f"{statistics.median(ratios):.2f}x",
                          f"{min(ratios):.2f}-{max(ratios):.2f}x")
        Console(width=max(Console().width, 100)).print(table)
        where = (f"within {check.tolerance:.0%} of 1 (the profile's own two passes ran "
                 f"{check.profile_repeat_spread:.0%} apart, median)")
        if check.holds:
            typer.echo(f"the profile holds here: its calls run at {ratio:.2f}x its times, {where}")
        else:
            family = points[0].spec.family
            on = "" if prof.device == "cpu" else f" --device cuda --dtype {prof.dtype}"
            typer.echo(f"the profile does not hold here: its calls run at {ratio:.2f}x its times, "
                       f"not {where}, so its predictions are off by about that factor; "
                       f"calibrate this machine (`costmodel calibrate --model {family}{on}`)")
    if not check.holds:
        raise typer.Exit(1)


@app.command("join-modes")
def join_modes_cmd(
    eager: Annotated[Path, typer.Argument(help="the GPU's eager-mode profile (JSON)")],
    graphs: Annotated[Path, typer.Argument(help="the same GPU's graphs-mode profile (JSON)")],
    out: Annotated[Path, typer.Option(help="the joint profile to write")],
    as_json: JsonOption = False,
) -> None:
    """Fit one GPU's eager and graphs calibrations together (the device's coefficients shared,
    each mode its own host terms) and validate across the modes: fitted on one mode's calls,
    priced on the other's. `predict --profile OUT --mode eager|graphs` then reads one fit."""
    from calibrate.modes import join_modes

    joint = join_modes(load_profile(eager), load_profile(graphs))
    save_profile(joint, out)
    if as_json:
        print_json({"profile": str(out),
                    "coefficients": {k: v.model_dump() for k, v in joint.coefficients.items()},
                    "held": {k: v.model_dump() for k, v in joint.held.items()},
                    "fit_stats": joint.fit_stats,
                    "cross_mode": [c.model_dump() for c in joint.cross_mode]})
        return
    typer.echo(f"{out}: {int(joint.fit_stats['train_points'])} calls of both modes fitted"
               + (f"; held: {', '.join(joint.held)}" if joint.held else ""))
    for check in joint.cross_mode:
        typer.echo(f"fitted on {check.fit_on} only, priced {check.predicted}: "
                   + error_summary((("calls", check.per_call), ("per token", check.per_token))))


@app.command("refit")
def refit_cmd(
    profile: Annotated[Path, typer.Argument(help="calibration profile (JSON)")],
    out: Annotated[Path, typer.Option(help="the refitted profile to write")],
    as_json: JsonOption = False,
) -> None:
    """Fit the profile's stored training calls again with this version's cost model (no
    measuring: the peaks, kernel counts and curve stay) and re-price its held-out points: what a
    profile made by an older version gains from the newer model."""
    from calibrate.refit import refit
    from calibrate.validate import report

    before = load_profile(profile)
    try:
        after = refit(before)
    except ValueError as exc:
        raise UserError(f"{profile}: {exc}") from None
    save_profile(after, out)
    reports = {label: report(p.validation, p.hardware, p.dtype) if p.validation else None
               for label, p in (("before", before), ("after", after))}
    if as_json:
        print_json({"profile": str(out),
                    "coefficients": {k: v.model_dump() for k, v in after.coefficients.items()},
                    "held": {k: v.model_dump() for k, v in after.held.items()},
                    "fit_stats": after.fit_stats,
                    **{label: None if rep is None else {"per_call": rep.per_call,
                                                        "per_token": rep.per_token}
                       for label, rep in reports.items()},
                    "cross_mode": [c.model_dump() for c in after.cross_mode]})
        return
    typer.echo(f"{out}: {int(after.fit_stats['train_points'])} training calls refitted"
               + (f"; held: {', '.join(after.held)}" if after.held else ""))
    for label, rep in reports.items():
        if rep is None:
            continue
        typer.echo(f"held-out, {label}: "
                   + error_summary((("calls", rep.per_call), ("per token", rep.per_token))))


@app.command("upgrade-profile")
def upgrade_profile_cmd(
    profile: Annotated[Path, typer.Argument(help="calibration profile (JSON) of an older schema")],
    out: Annotated[Path | None, typer.Option(help="where to write it (default: in place)")] = None,
    as_json: JsonOption = False,
) -> None:
    """Write a profile in the current schema (every command reads older ones through the same
    converter; this saves the conversion)."""
    import json

    try:
        before = json.loads(profile.read_text()).get("schema_version")
    except (OSError, ValueError, AttributeError):
        before = None
    prof = load_profile(profile)  # converts, or says why it cannot
    target = out or profile
    save_profile(prof, target)
    if as_json:
        print_json({"profile": str(target), "from_schema": before,
                    "schema_version": prof.schema_version,
                    "held": {k: v.model_dump() for k, v in prof.held.items()}})
        return
    typer.echo(f"{target}: schema {before} -> {prof.schema_version}"
               + (f"; held at priors: {', '.join(_undetermined(prof))}" if prof.held else ""))


main = run(app, (UnitError, UnknownPresetError, ProfileError, TraceError))
