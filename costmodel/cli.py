"""`costmodel` command line: the queries (predict, recommend), and the commands other packages
register (profiles, studies). Starts fast: no torch, scipy or matplotlib on this path."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from . import serving_cli
from .cli_options import (
    BatchOption,
    CommitAheadOption,
    ContextOption,
    DtypeOption,
    ExitDepthsOption,
    ExitRuleOption,
    HardwareOption,
    JsonOption,
    LinkBandwidthOption,
    LinkLatencyOption,
    LinkOption,
    MinDepthOption,
    ModelOption,
    NewTokensOption,
    ProfileOption,
    SequenceOverheadOption,
    StepOverheadOption,
    TensorParallelOption,
    TickOverheadOption,
    WaveOverheadOption,
    at_least_one,
    chosen_link,
    engine_overheads,
    exit_options,
    hardware_of,
    override_hardware,
    parallel_devices,
)
from .clitools import (
    UserError,
    flush_notes,
    print_json,
    run,
    spinner,
    text_table,
)
from .engines import ENGINES, VLLM_SOURCE, for_engine
from .errors import ProfileError, TraceError
from .hardware import EAGER_HOST_SOURCE, HardwareSpec
from .memory import DoesNotFit, does_not_fit
from .parallel import devices_text
from .predict import Prediction, predict
from .presets import UnknownPresetError, get_model
from .schedules import get as get_schedule
from .units import (
    UnitError,
    format_bytes,
)
from .workload import Workload

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Predict and explain the decoding speed of looped language models.")


@app.callback()
def _root() -> None:
    """Cost model of AR, draft-then-verify (DtV) and WaveFront Decoding (WFD)."""


def _flops_text(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.0f} TFLOPS" if flops_per_s >= 1e12 else \
        f"{flops_per_s / 1e9:.0f} GFLOPS"

def _print_table(p: Prediction) -> None:
    wl, hw, mem = p.workload, p.hardware, p.memory
    alpha = next((r.acceptance for r in p.schedules.values() if r.acceptance is not None), None)
    tp = hw.tensor_parallel
    typer.echo(
        f"{p.model} on {devices_text(hw)} "
        f"({hw.roofline.memory_bandwidth_bytes_per_s / 1e9:.0f} "
        f"GB/s, {_flops_text(hw.roofline.peak_flops_per_s.get(wl.dtype, 0))} {wl.dtype}, "
        f"{format_bytes(hw.roofline.memory_capacity_bytes)}), R = {p.depth}, context "
        f"{wl.context_length}"
        f" + {wl.new_tokens} new, batch {wl.batch_size}"
        + (f" (a run of {wl.prompts} prompts to its end), " if wl.prompts
           else " (steady state), " if wl.batch_size > 1 else ", ")
        + ("recurrence-specific KV" if wl.kv_sharing == 0 else f"KV shared over "
           f"{wl.kv_sharing} slot(s)")
        + (f", acceptance {alpha:.2f}" if alpha is not None else "")
        + (", CUDA graphs" if hw.graphs.cuda_graphs else "")
        + (f", exits at mean depth {p.schedules['ar'].mean_exit_depth:.2f}"
           + (", reference KV" if wl.exit_kv == "reference" else "") + " (WFD simulated)"
           if p.schedules and next(iter(p.schedules.values())).mean_exit_depth is not None
           else ""))
    fit = "fits" if mem.fits else "DOES NOT FIT"
    typer.echo(
        f"memory{' per device' if tp else ''}: {fit}: weights "
        f"{format_bytes(mem.weights_bytes)} + KV "
        f"{format_bytes(mem.kv_bytes)} + activations {format_bytes(mem.activation_bytes)} = "
        f"{format_bytes(mem.total_bytes)} of {format_bytes(mem.capacity_bytes)}; the longest "
        f"sequence that fits is {mem.max_context:,} tokens"
        + (f", the largest batch of this length {mem.max_batch:,}" if wl.batch_size > 1 else ""))
    if not mem.fits:
        return
    rows = []
    # the link's column where the devices are several
    terms = ["weights_s", "kv_s", "compute_s", "overhead_s"] + (["link_s"] if tp else [])
    for key, r in p.schedules.items():
        label = get_schedule(key).label(r.draft_depth, r.block_length, r.width, r.width_cap)
        b = r.breakdown
        rows.append([label, f"{r.latency_per_token_s * 1e3:.2f}", f"{r.tokens_per_s:.1f}",
                     f"{r.speedup_vs_ar:.2f}x", f"{r.block_calls_per_token:.2f}",
                     *(f"{getattr(b, t) * 1e3:.2f}" for t in terms),
                     f"{r.roofline_fraction:.0%}", r.bound])
    names = {"weights_s": "weights ms", "kv_s": "KV ms", "compute_s": "compute ms",
             "overhead_s": "overhead ms", "link_s": "link ms"}
    typer.echo(text_table(["schedule", "ms/token", "tokens/s", "speedup", "B calls/token",
                           *(names[t] for t in terms), "roofline", "bound"], rows,
                          left=(0, len(terms) + 6)))


def _placement(spec, hw, workload, layout: str | None, link) -> dict | None:
    """What ``--placement`` asks for (None: not asked)."""
    if layout is None:
        return None
    from .placement import place

    return place(spec, hw, workload, layout=layout, link=link)


def _print_placement(placed: dict) -> None:
    rows = [[name, f"{r.one_device_latency_s * 1e3:.2f}", f"{r.latency_s * 1e3:.2f}",
             "-" if r.across_wave_latency_s is None else f"{r.across_wave_latency_s * 1e3:.2f}",
             f"{r.pipelined_latency_s * 1e3:.2f}", r.busiest,
             f"{r.handoff_s * 1e3:.3f}"] for name, r in placed.items()]
    first = next(iter(placed.values()))
    widest = max(placed.values(), key=lambda r: max(r.device_bytes.values()))
    typer.echo(f"memory per device ({widest.schedule}'s): " + ", ".join(
        f"{parts} {format_bytes(size)}" for parts, size in widest.device_bytes.items())
        + ("" if widest.fits else " (DOES NOT FIT)"))
    typer.echo(text_table(
        ["schedule", "1 device ms", "placed ms", "across the wave ms", "pipelined ms",
         "busiest", "hand-offs ms"], rows, left=(0, 5),
        title=f"placed {first.layout} on {first.devices} devices (ms per token of a sequence; "
              "pipelined: of a group, with every device busy)"))


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
        help="0: one KV slot per depth; S in 1..R: S shared slots")] = 0,
    exit_rule: ExitRuleOption = None,
    min_depth: MinDepthOption = 1,
    exit_depths: ExitDepthsOption = None,
    exit_kv: Annotated[str, typer.Option(
        help="with exits, what later tokens read of an exited token's skipped depths: latest "
             "(its KV at its exit) or reference (the public Huginn code's: a wave defers "
             "readouts until older tokens are final)")] = "latest",
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
    step_overhead: StepOverheadOption = "0s",
    sequence_overhead: SequenceOverheadOption = "0s",
    tick_overhead: TickOverheadOption = "0s",
    wave_overhead: WaveOverheadOption = "0s",
    commit_ahead: CommitAheadOption = 8,
    tensor_parallel: TensorParallelOption = 1,
    link: LinkOption = None,
    link_bandwidth: LinkBandwidthOption = None,
    link_latency: LinkLatencyOption = None,
    placement: Annotated[str | None, typer.Option(
        help="also price each schedule with its model's parts on devices of their own: "
             "p|r|c (prelude | block | coda) or pc|r (prelude and coda | block), joined by "
             "--link")] = None,
    as_json: JsonOption = False,
) -> None:
    """Per-token latency, speedup and its breakdown for AR, DtV and WFD."""
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise UserError(f"acceptance must be in [0, 1], got {acceptance}")
    at_least_one(context=context, new_tokens=new_tokens, batch=batch, prompts=prompts)
    if depth is not None and depth < 2:
        raise UserError(f"depth R must be at least 2, got {depth}")
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; use {' or '.join(ENGINES)}")
    prof, base, dtype = hardware_of(profile, hardware, dtype)
    spec = get_model(model)
    base = for_engine(engine, base, spec)
    hw = override_hardware(base, bandwidth, flops, memory, launch_overhead, dtype, mode, host_speed)
    spec, hw = parallel_devices(spec, hw, tensor_parallel, link, link_bandwidth, link_latency,
                                placement)
    exits = exit_options(exit_rule, min_depth, exit_depths, depth or spec.default_depth,
                         exit_kv, depth_trace)
    workload = Workload(context_length=context, new_tokens=new_tokens, acceptance=acceptance,
                        depth_trace=str(depth_trace) if depth_trace else None,
                        batch_size=batch, dtype=dtype, kv_sharing=kv_sharing, depth=depth,
                        prompts=prompts, **exits)
    # a run of prompts is simulated call by call: seconds, where the closed forms take a blink
    with spinner(f"simulating {prompts} prompts x {new_tokens} tokens, batch {batch}, for AR, "
                 "DtV and WFD", disable=as_json or prompts is None):
        result = predict(spec, hw, workload, width=width, draft_depth=draft_depth,
                         block_length=block_length,
                         engine=engine_overheads(step_overhead, sequence_overhead,
                                                 tick=tick_overhead, wave=wave_overhead,
                                                 commit_ahead=commit_ahead),
                         continuous_depth=engine == "vllm")
    flush_notes()  # the input priced: the notes on how it was priced
    loose = undetermined(prof) if prof is not None else []
    host = _host_source(result.hardware, launch_overhead, host_speed)
    if engine == "vllm":
        host = VLLM_SOURCE.format(mode="CUDA graphs" if result.hardware.graphs.cuda_graphs
                                  else "eager (enforce_eager)")
    placed = _placement(spec, hw, workload, placement,
                        chosen_link(hw, link, link_bandwidth, link_latency))
    if as_json:
        print_json({**result.model_dump(mode="json"), "host_source": host, "engine": engine,
                    "hardware": result.hardware.name, "hardware_spec": result.hardware.flat(),
                    "mode": result.hardware.mode, "host_speed": host_speed or 1.0,
                    "profile_undetermined": loose,
                    **({} if placed is None else {"placement": {
                        k: v.model_dump(mode="json") for k, v in placed.items()}})})
    else:
        _print_table(result)
        if placed is not None:
            _print_placement(placed)
        note_undetermined(loose)
        if host is not None:
            typer.echo(f"note: {'engine' if engine == 'vllm' else 'host'}: {host}", err=True)
    if result.memory.fits and context + new_tokens > spec.max_position_embeddings:  # no run
        typer.echo(f"note: {spec.name} has {spec.max_position_embeddings:,} positions; "
                   f"{context:,} + {new_tokens:,} tokens is priced as the architecture would run "
                   "it (the decoder refuses it)", err=True)
    if not result.memory.fits and not (placed and all(r.fits for r in placed.values())):
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
    at_least_one(context=context, new_tokens=new_tokens, batch=batch, top=top)
    spec = get_model(model)
    if depth_trace is not None:
        trace = read_depth_trace(depth_trace)
        if trace.header.depth != spec.default_depth:
            raise UserError(f"the depth trace was recorded at R = {trace.header.depth} "
                            f"({trace.header.model}); {model} runs at R = {spec.default_depth}")
        acceptance = trace.acceptance_by_depth()
    else:
        acceptance = parse_acceptance_by_depth(acceptance_by_depth)
    _, hw, dtype = hardware_of(profile, hardware, dtype)
    workload = Workload(context_length=context, new_tokens=new_tokens, batch_size=batch,
                        dtype=dtype)
    try:
        choices = recommend(spec, hw, acceptance, workload, top=top)
        flush_notes()
    except DoesNotFit as exc:  # an answer, as predict gives it: exit 1, not bad input's 2
        flush_notes()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
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


def _host_source(hw: HardwareSpec, launch_overhead: str | None, host_speed: float | None
                 ) -> str | None:
    """Where a preset's host terms come from (None: a profile's, calibrated with its counts)."""
    if hw.operations.kernels_per_layer is not None:
        return None
    if launch_overhead is None:
        source = EAGER_HOST_SOURCE
    else:
        source = (f"{launch_overhead} per dispatched operation (--launch-overhead) x this "
                  "decoder's operations per call (costmodel/data/operations.json)")
    return source + (f", / {host_speed:g} (--host-speed)" if host_speed is not None else "")


def undetermined(profile) -> list[str]:
    """The coefficients the profile holds at priors (its calls did not determine them)."""
    return sorted(name for name, held in profile.held.items() if held.prior)


def note_undetermined(loose: list[str]) -> None:
    # e.g. an eager decoder on a GPU: the host hid the device, so bandwidth and flops are
    # priors, and the terms they price are not calibrated
    if loose:
        typer.echo(f"note: the profile holds {', '.join(loose)} at priors (its calls do not "
                   "determine them): the terms they price are not calibrated", err=True)


@functools.cache  # once per process: main() may run more than once (tests)
def _add_registered_commands() -> int:
    """Add the commands other packages register under the entry-point group
    ``costmodel.commands`` (calibration's profile commands, the studies): the cost model knows
    none of them, and a query such as `predict` starts without loading them. Returns how many
    packages registered."""
    from importlib.metadata import entry_points

    entries = entry_points(group="costmodel.commands")
    for entry in entries:
        entry.load()(app)
    return len(entries)


serving_cli.register(app)
run_app = run(app, (UnitError, UnknownPresetError, ProfileError, TraceError))
OWN_COMMANDS = ("predict", "recommend", "serving")


def main() -> None:
    import sys

    command = sys.argv[1:2]
    if command not in ([c] for c in OWN_COMMANDS):  # help, or another package's command
        if not _add_registered_commands() and command and not command[0].startswith("-"):
            # an install from before the entry points existed: its metadata lacks them
            typer.echo(f"error: no command {command[0]!r}: the profile commands and `study` "
                       "register at install time; reinstall (pip install -e .)", err=True)
            raise SystemExit(2)
    run_app()
