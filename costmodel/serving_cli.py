"""`costmodel serving`: a stream of requests served with AR, DtV and WFD (costmodel.serving),
their latency percentiles, throughput and goodput, and the highest rate meeting the latency
objectives. ``register`` adds it to the `costmodel` app (costmodel.cli)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from .cli_options import (
    CommitAheadOption,
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
    ProfileOption,
    SequenceOverheadOption,
    StepOverheadOption,
    TensorParallelOption,
    TickOverheadOption,
    WakeOverheadOption,
    WaveOverheadOption,
    at_least_one,
    chosen_link,
    engine_overheads,
    exit_options,
    hardware_of,
    override_hardware,
    parallel_devices,
)
from .clitools import UserError, one_of, print_json, spinner, stderr_progress, text_table
from .engines import for_engine
from .figures import NO_PLOTS, latency_against_rate, save_figure
from .parallel import devices_text
from .presets import get_model
from .units import parse_duration, parse_rate


def _requests(requests_file: Path | None, rate: str | None, count: int,
              prompt_tokens: str | None, output_tokens: str | None, lengths: str | None,
              arrivals: str, seed: int, context: int):
    """The stream: read from a file, or drawn (a function of the rate, for the rate search)
    with fixed or uniform lengths, or pairs of a shipped sample that fit ``context``."""
    from .requests import Lengths, LengthSample, read_requests, request_stream

    if requests_file is not None:
        if rate is not None or lengths is not None:
            raise UserError("give --rate and --lengths or --requests-file, not both (the file's "
                            "arrival times are the rate, its lengths the lengths)")
        fixed = read_requests(requests_file)
        return lambda _rate=None: fixed
    sample = None
    if lengths is not None:
        if prompt_tokens is not None or output_tokens is not None:
            raise UserError("--lengths draws prompt and output lengths together: leave out "
                            "--prompt-tokens and --output-tokens")
        sample = LengthSample.load(lengths)
        share = sample.fitting_share(context)
        if share < 0.999:
            from .clitools import note

            note(f"lengths: {sample.name}'s requests that fit the model's context of {context} "
                 f"tokens ({share:.1%} of them)")
    prompt = Lengths.parse(prompt_tokens or "512", "--prompt-tokens")
    output = Lengths.parse(output_tokens or "256", "--output-tokens")
    return lambda per_s: request_stream(per_s, count, prompt, output, arrivals=arrivals,
                                        seed=seed, lengths=sample, context=context)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _print(results, rates: dict[str, float | None], title: str, searched: str) -> None:
    headers = ["schedule", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "E2E p50/p99 s",
               "tokens/s", "req/s", "batch", "SLOs met", "goodput req/s"]
    if rates:
        headers.append(f"highest rate /s ({searched})")
    rows = []
    for name, r in results.items():
        row = [r.options.removeprefix("--schedule "),
               " / ".join(_ms(getattr(r.ttft_s, p)) for p in ("p50", "p90", "p99")),
               " / ".join(_ms(getattr(r.tpot_s, p)) for p in ("p50", "p90", "p99")),
               f"{r.e2e_s.p50:.2f} / {r.e2e_s.p99:.2f}", f"{r.throughput_tokens_per_s:,.1f}",
               f"{r.requests_per_s:.2f}", f"{r.mean_batch:.1f}",
               "-" if r.slo_attainment is None else f"{r.slo_attainment:.0%}",
               "-" if r.goodput_requests_per_s is None else f"{r.goodput_requests_per_s:.2f}"]
        if rates:
            rate = rates.get(name)
            row.append("none tried" if rate is None else f"{rate:.3g}")
        rows.append(row)
    typer.echo(text_table(headers, rows, title=title))


def register(app: typer.Typer) -> None:
    app.command("serving")(serving_cmd)


def serving_cmd(
    model: ModelOption = "huginn-3.5b",
    hardware: HardwareOption = "a6000",
    profile: ProfileOption = None,
    engine: Annotated[str, typer.Option(help="wfd (this decoder) or vllm")] = "wfd",
    rate: Annotated[str | None, typer.Option(
        help="request rate, e.g. 4/s, 240/min (default 1/s)")] = None,
    requests: Annotated[int, typer.Option("--requests", help="requests in the stream")] = 200,
    prompt_tokens: Annotated[str | None, typer.Option(
        help="prompt length: N, or LOW-HIGH drawn uniformly (default 512)")] = None,
    output_tokens: Annotated[str | None, typer.Option(
        help="tokens each request asks for: N, or LOW-HIGH drawn uniformly (default 256)")
    ] = None,
    lengths: Annotated[str | None, typer.Option(
        help="prompt and output lengths drawn together from a trace of real requests: "
             "azure-conv-2023 or azure-code-2023 (shipped), or a JSON file of the same form "
             "(bench/length_samples.py makes one)")] = None,
    arrivals: Annotated[str, typer.Option(help="poisson or uniform")] = "poisson",
    requests_file: Annotated[Path | None, typer.Option(
        help="JSON Lines of requests (arrival_s, prompt_tokens, output_tokens) instead of a "
             "drawn stream")] = None,
    max_batch: Annotated[int, typer.Option(
        help="at most this many sequences decoded together (vLLM's max_num_seqs)")] = 16,
    slo_ttft: Annotated[str | None, typer.Option(
        help="time-to-first-token objective, e.g. 500ms")] = None,
    slo_tpot: Annotated[str | None, typer.Option(
        help="time-per-output-token objective, e.g. 50ms")] = None,
    rates: Annotated[str | None, typer.Option(
        help="several rates, e.g. 0.5/s,1/s,2/s: the stream at each (a table each; --plot "
             "draws latency against them)")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="with --rates: a figure (PNG) of TTFT and TPOT against the rate")] = None,
    find_rate: Annotated[bool, typer.Option(
        help="also search the highest rate at which --attainment of the requests meet the "
             "objectives (a step at a time unless --fidelity calls: a search simulates the "
             "stream a dozen times a schedule)")] = False,
    attainment: Annotated[float, typer.Option(
        help="the fraction of requests that must meet the objectives")] = 0.9,
    schedule: Annotated[list[str] | None, typer.Option(
        help="ar, dtv or wfd (repeat for several; default all)")] = None,
    depth: Annotated[int | None, typer.Option(help="recurrence depth R")] = None,
    draft_depth: Annotated[int | None, typer.Option(help="draft depth d (< R)")] = None,
    width: Annotated[int | None, typer.Option(help="WFD width W")] = None,
    block_length: Annotated[int | None, typer.Option(help="DtV block length k")] = None,
    acceptance: Annotated[float | None, typer.Option(
        help="draft acceptance in [0, 1] (default: the model's)")] = None,
    kv_sharing: Annotated[int, typer.Option(help="0: a KV slot per depth; S shared")] = 0,
    exit_rule: ExitRuleOption = None,
    min_depth: MinDepthOption = 1,
    exit_depths: ExitDepthsOption = None,
    depth_trace: Annotated[Path | None, typer.Option(
        help="--exit: a measured depth trace, whose tokens' exit depths under the rule the "
             "stream's tokens take")] = None,
    seed: Annotated[int, typer.Option(help="seed of the arrivals, lengths and drafts")] = 0,
    step_overhead: StepOverheadOption = "0s",
    sequence_overhead: SequenceOverheadOption = "0s",
    request_overhead: Annotated[str, typer.Option(
        help="its time per request on the way in and its first token's out (parsing, "
             "tokenizing, streaming), the engine free meanwhile, e.g. 5ms")] = "0s",
    prompt_overhead: Annotated[str, typer.Option(
        help="its time per step that prefills prompts, beyond a step's (their inputs; the "
             "plugin's readouts), the engine busy, e.g. 8ms")] = "0s",
    tick_overhead: TickOverheadOption = "0s",
    wave_overhead: WaveOverheadOption = "0s",
    commit_ahead: CommitAheadOption = 8,
    wake_overhead: WakeOverheadOption = None,
    tensor_parallel: TensorParallelOption = 1,
    link: LinkOption = None,
    link_bandwidth: LinkBandwidthOption = None,
    link_latency: LinkLatencyOption = None,
    placement: Annotated[str | None, typer.Option(
        help="the model's parts on devices of their own, joined by --link: p|r|c (prelude | "
             "block | coda) or pc|r (prelude and coda | block); the running sequences "
             "pipelined over them in groups (with --fidelity steps)")] = None,
    fidelity: Annotated[str | None, typer.Option(
        help="calls (each call of each sequence simulated: drafts' acceptance drawn; the "
             "default) or steps (a step at a time from the closed forms: hundreds of times "
             "faster, for long streams; the default with exits and for --find-rate's "
             "search)")] = None,
    token_budget: Annotated[int | None, typer.Option(
        help="with --fidelity steps: schedule as vLLM does, this many tokens a step (its "
             "max_num_batched_tokens) shared by decoding and chunked prefills, KV taken as "
             "tokens come and the newest request preempted when it runs out")] = None,
    per_request: Annotated[Path | None, typer.Option(
        help="also write each request as served (JSON Lines: the rate, schedule, its arrival "
             "and lengths, TTFT, TPOT and latency in seconds)")] = None,
    dtype: DtypeOption = None,
    as_json: JsonOption = False,
) -> None:
    """Serve a stream of requests: TTFT, TPOT and latency percentiles, throughput and goodput
    for AR, DtV and WFD (simulated call by call, or step by step, priced by the cost model)."""
    from .serving import FIDELITIES

    names, ttft, tpot = _checked(requests, max_batch, acceptance, attainment,
                                 schedule, slo_ttft, slo_tpot, find_rate)
    sweep = _sweep(rate, rates, requests_file, plot)
    per_s = sweep[0]
    _, base, dtype = hardware_of(profile, hardware, dtype)
    spec = get_model(model)
    stream = _requests(requests_file, rate, requests, prompt_tokens, output_tokens, lengths,
                       arrivals, seed, spec.max_position_embeddings)
    hw = override_hardware(for_engine(engine, base, spec), None, None, None, None, dtype)
    spec, hw = parallel_devices(spec, hw, tensor_parallel, link, link_bandwidth, link_latency,
                                placement)
    exits = _exits(exit_rule, min_depth, exit_depths, depth_trace, depth or spec.default_depth)
    if exits and not schedule:  # those with a closed form under exits (predict_serving's)
        names = None
    options = {"max_batch": max_batch, "depth": depth, "dtype": dtype, "kv_sharing": kv_sharing,
               "acceptance": acceptance, "draft_depth": draft_depth, "width": width,
               "block_length": block_length, "slo_ttft_s": ttft, "slo_tpot_s": tpot,
               "seed": seed,
               "fidelity": one_of("fidelity", fidelity or ("steps" if exits else "calls"),
                                  FIDELITIES),
               "token_budget": token_budget, "placement": placement,
               "link": chosen_link(hw, link, link_bandwidth, link_latency) if placement else None,
               "engine": engine_overheads(step_overhead, sequence_overhead, request_overhead,
                                         tick_overhead, wave_overhead, commit_ahead,
                                         wake_overhead, prompt_overhead),
               "exits": exits or None, "continuous_depth": engine == "vllm"}
    head = {"model": spec.name, "hardware": hw.name, "engine": engine,
            **({"placement": placement} if placement else {}),
            "requests": len(stream(per_s)), "max_batch": max_batch,  # a requests file's too
            **({"lengths": lengths} if lengths else {})}
    runs, names = _served(spec, hw, stream, sweep, names, options, head["requests"],
                          per_request is not None, as_json)
    if per_request is not None:
        _write_per_request(per_request, runs, stream, requests_file is None)
    # the search simulates the stream a dozen times a schedule: a step at a time unless asked
    searched = fidelity or "steps"
    found = _highest_rates(spec, hw, stream, names, {**options, "fidelity": searched}, per_s,
                           attainment, as_json) if find_rate else {}
    if plot is not None and not save_figure(plot, _latency_figure(runs, ttft, tpot), (10, 4)):
        typer.echo(NO_PLOTS, err=True)
    if as_json:
        dumped = [{"rate_per_s": None if requests_file else r,
                   "schedules": {n: x.model_dump(mode="json") for n, x in results.items()}}
                  for r, results in runs]
        print_json({**head, **(dumped[0] if rates is None else {"sweep": dumped}),
                    **({"highest_rate_per_s": found, "rate_search_fidelity": searched}
                       if find_rate else {})})
        return
    for r, results in runs:
        source = f"{requests_file}" if requests_file else f"{r:g}/s {arrivals}" + (
            f", lengths of {lengths}" if lengths else "")
        _print(results, found, _title(spec, hw, placement, options["link"], results, source,
                                      head["requests"], max_batch), searched)
    if engine == "vllm" and options["engine"] is None:
        typer.echo("note: the engine's own time (scheduling, sampling, output) is not counted: "
                   "give --step-overhead, --sequence-overhead, --prompt-overhead and "
                   "--request-overhead "
                   "(bench/serving_load.py measures vLLM's)", err=True)


def _served(spec, hw, stream, sweep: list[float], names: list[str] | None, options: dict,
            count: int, keep: bool, quiet: bool) -> tuple[list, list[str]]:
    """Each rate's stream served, (rate, results by schedule), and the schedules served (with
    exits and none named, those with a closed form: WFD is left out, with a note)."""
    from .serving import predict_serving

    runs = []
    with _serving_progress(count, len(sweep), len(names or ()), options["fidelity"],
                           quiet) as advance:
        for r in sweep:
            runs.append((r, predict_serving(spec, hw, stream(r), names=names, keep_served=keep,
                                            on_served=advance, **options)))
    if names is None:
        names = list(runs[0][1])
        if not quiet:
            typer.echo("note: WFD with exits is left out: a stream's steps are priced from the "
                       "closed forms, and WFD's with exits is simulated (costmodel predict "
                       "--exit-depths)", err=True)
    return runs, names


@contextmanager
def _serving_progress(requests: int, rates: int, schedules: int, fidelity: str, quiet: bool):
    """A function to call as each request is served: call by call (about 30-50 s a 1,000
    requests a schedule on a 2-core VM) a bar of the requests served over every schedule and
    rate, and a hint when the stream is long; step by step a spinner (a stream takes well under
    a second)."""
    if fidelity != "calls" or quiet:
        with spinner(f"serving {requests} requests at {rates} rate(s)", disable=quiet):
            yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    hint = " (--fidelity steps: hundreds of times faster)" if requests >= 1000 else ""
    with stderr_progress(TextColumn(f"requests served, call by call{hint}"), BarColumn(),
                         MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        task = progress.add_task("", total=requests * rates * schedules)
        yield lambda: progress.advance(task)


def _exits(rule: str | None, min_depth: int, exit_depths: str | None,
           depth_trace: Path | None, depth: int) -> dict:
    """The stream's adaptive depth as a workload's exit fields (empty: fixed depth)."""
    if depth_trace is not None and rule is None:
        raise UserError("--depth-trace gives the exit depths of an --exit rule: give one")
    exits = exit_options(rule, min_depth, exit_depths, depth, depth_trace=depth_trace)
    if depth_trace is not None:
        exits["depth_trace"] = str(depth_trace)
    return exits


def _title(spec, hw, placement: str | None, link, results, source: str, requests: int,
           max_batch: int) -> str:
    """A run's table title: the model, its devices, the stream and the batch (and exits)."""
    from .placement import devices

    where = devices_text(hw) if placement is None else (
        f"{hw.name} x {len(devices(placement))} placed {placement} over {link.name}")
    depth = next(iter(results.values())).mean_exit_depth
    return (f"{spec.name} on {where}, {requests} requests ({source}), at most {max_batch} "
            "together" + (f", exits at mean depth {depth:.2f}" if depth else ""))


def _sweep(rate: str | None, rates: str | None, requests_file: Path | None,
           plot: Path | None) -> list[float]:
    """The rates to serve the stream at (requests a second), the options checked."""
    if rates is not None and requests_file is not None:
        raise UserError("--rates draws a stream at each rate: give it or --requests-file")
    sweep = [parse_rate(r) for r in rates.split(",")] if rates is not None else \
        [parse_rate(rate) if rate is not None else 1.0]
    if plot is not None and len(sweep) < 2:
        raise UserError("--plot needs two rates or more (--rates 1/s,2/s,4/s)")
    return sweep


def _write_per_request(path: Path, runs, stream, drawn: bool) -> None:
    """Each request of each run and schedule as served, a JSON line each (atomically)."""
    from .trace import atomic_write

    lines = []
    for r, results in runs:
        requests = stream(r)
        for name, result in results.items():
            for i, (asked, s) in enumerate(zip(requests, result.served, strict=True)):
                lines.append(json.dumps({
                    "rate_per_s": r if drawn else None, "schedule": name, "request": i,
                    "arrival_s": s.arrival_s, "prompt_tokens": asked.prompt_tokens,
                    "output_tokens": s.output_tokens, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s,
                    "e2e_s": s.e2e_s}))
    atomic_write(path, "".join(line + "\n" for line in lines))


def _checked(requests, max_batch, acceptance, attainment, schedule,
             slo_ttft, slo_tpot, find_rate) -> tuple[list[str], float | None, float | None]:
    """The schedules to run and the objectives (seconds), the options checked."""
    from .schedules import SCHEDULES

    at_least_one(requests=requests, max_batch=max_batch)
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise UserError(f"acceptance must be in [0, 1], got {acceptance}")
    if not 0 < attainment <= 1:
        raise UserError(f"attainment must be in (0, 1], got {attainment}")
    names = schedule or list(SCHEDULES)
    for name in names:
        if name not in SCHEDULES:
            raise UserError(f"unknown schedule {name!r}; use {', '.join(SCHEDULES)}")
    ttft = parse_duration(slo_ttft) if slo_ttft is not None else None
    tpot = parse_duration(slo_tpot) if slo_tpot is not None else None
    if find_rate and ttft is None and tpot is None:
        raise UserError("--find-rate searches the rate that meets --slo-ttft and --slo-tpot: "
                        "give one or both")
    return names, ttft, tpot


def _highest_rates(spec, hw, stream, names, options, start_per_s, attainment, quiet
                   ) -> dict[str, float | None]:
    """Each schedule's highest rate at which ``attainment`` of the requests meet the
    objectives."""
    from .serving import highest_rate, predict_serving

    found: dict[str, float | None] = {}
    with spinner("searching the highest rate that meets the objectives", disable=quiet):
        for name in names:
            def meets(r: float, name: str = name) -> bool:
                result = predict_serving(spec, hw, stream(r), names=[name], **options)
                return result[name].slo_attainment >= attainment
            found[name] = highest_rate(meets, start_per_s=start_per_s)
    return found


def _latency_figure(runs, ttft: float | None, tpot: float | None):
    """Draws TTFT and TPOT (p50 solid, p99 dotted) against the rate, a line per schedule."""
    def draw(fig) -> None:
        for ax, key, objective, label in zip(
                fig.subplots(1, 2), ("ttft_s", "tpot_s"), (ttft, tpot),
                ("time to first token (ms)", "time per output token (ms)"), strict=True):
            points = {name: [(r, getattr(results[name], key).p50,
                              getattr(results[name], key).p99) for r, results in runs]
                      for name in runs[0][1]}
            latency_against_rate(ax, points, label, objective)
    return draw
