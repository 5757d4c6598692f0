"""`wfd` command line: generate with a looped LM and write its traces."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from costmodel.clitools import (
    UserError,
    check_writable,
    flush_notes,
    note,
    one_of,
    print_json,
    run,
)
from costmodel.schedules import AR

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Decode looped language models (Huginn, Ouro) with AR, DtV or WFD.")

DEFAULT_MODEL = "huginn-tiny"


@app.callback()
def _root() -> None:
    """WaveFront Decoding of looped LMs."""


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError(f"{what} is empty")
    return ids


@app.command()
def generate(
    model: Annotated[str, typer.Option(
        help="checkpoint folder, shipped model (huginn-tiny, ouro-tiny) or PRESET:random")
    ] = DEFAULT_MODEL,
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="prompt token ids, e.g. 1,2,3")] = None,
    schedule: Annotated[str, typer.Option(
        help="ar, dtv, wfd, or auto (the cost model picks one from the prompt's acceptance)")
    ] = "ar",
    profile: Annotated[Path | None, typer.Option(
        help="auto: the calibration profile to decide with (default: this machine's)")] = None,
    draft_depth: Annotated[int | None, typer.Option(
        help="DtV/WFD draft depth d (default: the model's)")] = None,
    width: Annotated[int | None, typer.Option(
        help="WFD width W: draft depth ceil(R / W)")] = None,
    width_cap: Annotated[int | None, typer.Option(
        help="WFD: at most this many positions in flight")] = None,
    block_length: Annotated[int, typer.Option(help="DtV block length k")] = 4,
    force_acceptance: Annotated[float | None, typer.Option(
        help="timing mode: verification accepts drafts with this probability instead of "
             "comparing tokens (NOT a real decode)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass")] = 1.0,
    seed: Annotated[int, typer.Option(help="seeds sampling and Huginn's initial state")] = 0,
    init_scale: Annotated[float, typer.Option(
        help="Huginn's initial-state scale (0: the zero state)")] = 1.0,
    depth: Annotated[int | None, typer.Option(help="recurrence depth R")] = None,
    kv_sharing: Annotated[int, typer.Option(
        help="0: one KV slot per depth; S in 1..R: S shared slots")] = 0,
    stop_ids: Annotated[str | None, typer.Option(help="token ids that end generation")] = None,
    exit_rule: Annotated[str | None, typer.Option(
        "--exit", help="adaptive depth: RULE[:THRESHOLD], each token stops at the first depth "
        "the rule fires: kl, entropy-diff, latent-diff, argmax-stable, or gate (a model with "
        "an exit gate)")] = None,
    min_depth: Annotated[int, typer.Option(
        help="--exit: the shallowest depth a token may stop at")] = 1,
    exit_kv: Annotated[str, typer.Option(
        help="--exit: what later tokens read of the depths a token skipped: latest (its KV at "
             "its exit depth) or reference (the public Huginn code's: absent; one coda slot "
             "holding its final readout)")] = "latest",
    force_exits: Annotated[str | None, typer.Option(
        help="timing mode: each token exits at a depth drawn from this distribution, e.g. "
             "\"8:0.5,16:0.5\", instead of where a rule fires (NOT a real decode)")] = None,
    draft_when: Annotated[str | None, typer.Option(
        help="dtv/wfd, adaptive drafting: RULE:THRESHOLD (the --exit rules, looser), a token "
             "drafts at the first depth it fires, --draft-depth the deepest")] = None,
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16")] = "fp32",
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    mode: Annotated[str | None, typer.Option(
        help="eager; static (fixed shapes from static buffers); graphs (static, each shape "
             "captured once as a CUDA graph). Default: graphs on CUDA, eager on CPU")] = None,
    trace: Annotated[Path | None, typer.Option(help="write the call trace (JSON Lines)")] = None,
    depth_trace: Annotated[Path | None, typer.Option(
        help="write the depth trace (JSON Lines): y(p, r) for every depth")] = None,
    prompts_file: Annotated[Path | None, typer.Option(
        help="decode many prompts, B at a time: a JSON Lines file of {\"prompt\": ...} or "
             "{\"prompt_ids\": [...]}, each with an optional max_new_tokens")] = None,
    batch_size: Annotated[int, typer.Option(
        help="--prompts-file: sequences decoded together (continuous batching)")] = 8,
    out: Annotated[Path | None, typer.Option(
        help="--prompts-file: write one JSON object per prompt here, in the file's order "
             "(default: standard output)")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="print one JSON object (with --prompts-file: the run's totals)")] = False,
) -> None:
    """Generate from a prompt (or a prompts file, in batches); print the text (or token ids)
    and the decoding statistics."""
    from wfd.options import RunOptions

    _check_sources(prompt, prompt_ids, prompts_file, out, batch_size, as_json)
    one_of("device", device.split(":")[0], ("cpu", "cuda"))
    if init_scale < 0:
        raise UserError(f"init scale must be >= 0, got {init_scale}")
    # the run object refuses bad settings in one line (a ValueError: exit 2) before torch loads
    options = RunOptions.of(settings=dict(
        schedule=schedule, max_new_tokens=max_new_tokens, depth=depth, draft_depth=draft_depth,
        width=width, width_cap=width_cap, block_length=block_length, kv_sharing=kv_sharing,
        exit_rule=exit_rule, min_depth=min_depth, exit_kv=exit_kv, force_exits=force_exits,
        draft_rule=draft_when, temperature=temperature, top_p=top_p, seed=seed,
        stop_tokens=_parse_ids(stop_ids, "--stop-ids") if stop_ids else frozenset(),
        force_acceptance=force_acceptance, mode=mode, dtype=dtype))
    if prompts_file is not None and (options.auto or depth_trace is not None):
        raise UserError("a prompts file decodes with --schedule ar, dtv or wfd, without "
                        "--depth-trace")
    if depth_trace is not None and options.schedule != AR.name:
        raise UserError("--depth-trace is recorded by an AR run (--schedule ar)")
    _check_outputs(trace, depth_trace, out, prompts_file)
    import torch  # heavy: only once the arguments are known to be sane

    from .checkpoint import SHIPPED_DIR, load_model
    from .runtime import check_prompt, check_run
    from .tokenizer import tokenizer_for

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} is not available (torch sees no CUDA device)")
    if mode == "graphs" and not device.startswith("cuda"):
        raise UserError("--mode graphs captures CUDA graphs: it needs --device cuda (on a CPU, "
                        "--mode static runs the same fixed-shape calls without capture)")
    # a CheckpointError or GenerationError is a ValueError: one line, exit 2 (run)
    net = load_model(model, device=device, dtype=dtype, init_scale=init_scale, seed=seed)
    folder = Path(model) if Path(model).is_dir() else SHIPPED_DIR / model
    tok = tokenizer_for(folder if folder.is_dir() else None, net.config.vocab_size)
    if options.stop_tokens:
        check_prompt(sorted(options.stop_tokens), net.config.vocab_size, "--stop-ids")
    if prompts_file is not None:
        return _generate_file(net, tok, prompts_file, out, options, model=model, device=device,
                              trace=trace, as_json=as_json, batch_size=batch_size)
    if prompt is not None and tok is None:
        raise UserError(f"{model} has no tokenizer.json; give --prompt-ids")
    ids = tok.encode(prompt) if prompt is not None else _parse_ids(prompt_ids, "--prompt-ids")
    check_prompt(ids, net.config.vocab_size)
    # refused before auto's profile is found (or made here, seconds), not after
    check_run(net, len(ids), options.max_new_tokens, options.depth or net.config.depth,
              options.kv_sharing)
    hardware = _auto_hardware(net, model, profile, device, dtype) if options.auto else None
    from .generate import generate as decode

    result = decode(net, ids, options, depth_trace=depth_trace is not None, hardware=hardware)
    flush_notes()
    _write_traces(result, trace, depth_trace, model=model, device=device, dtype=dtype,
                  depth=options.depth or net.config.depth)
    _report(result, tok, as_json)


def _check_sources(prompt: str | None, prompt_ids: str | None, prompts_file: Path | None,
                   out: Path | None, batch_size: int, as_json: bool) -> None:
    """One prompt (text or ids) or a prompts file, with the options that go with each."""
    if prompts_file is None:
        if (prompt is None) == (prompt_ids is None):
            raise UserError("give exactly one of --prompt and --prompt-ids (or --prompts-file)")
        if out is not None or batch_size != 8:
            raise UserError("--out and --batch-size go with --prompts-file")
        return
    if prompt is not None or prompt_ids is not None:
        raise UserError("give --prompts-file or a prompt (--prompt, --prompt-ids), not both")
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    try:  # before the model loads (seconds), as reading it in the run would say it
        prompts_file.open().close()
    except OSError as exc:
        raise UserError(f"cannot read the prompts file {prompts_file}: {exc.strerror}") from None
    if as_json and out is None:
        raise UserError("--json prints the run's totals: give --out for the per-prompt results")


def _check_outputs(trace: Path | None, depth_trace: Path | None, out: Path | None,
                   prompts_file: Path | None) -> None:
    """Files to write that are distinct, apart from the input, and writable."""
    outputs = [p.resolve() for p in (trace, depth_trace, out) if p is not None]
    if len(set(outputs)) < len(outputs) or (prompts_file and prompts_file.resolve() in outputs):
        raise UserError("--trace, --depth-trace, --out and --prompts-file must be different "
                        "files (one would overwrite another)")
    check_writable(trace, depth_trace, out)


def _auto_hardware(net, model: str, profile: Path | None, device: str, dtype: str):
    """The calibrated hardware ``--schedule auto`` decides with: ``--profile``'s (of the run's
    device and dtype), or this machine's calibration, or one made here in about a second."""
    from costmodel.profile import load_profile

    if profile:
        chosen, calibrated = profile, load_profile(profile)
        ran = (calibrated.device.split(":")[0], calibrated.dtype)
        if ran != (device.split(":")[0], dtype):
            raise UserError(f"--profile {profile} was calibrated on {ran[0]} in {ran[1]}; "
                            f"this run decodes on {device} in {dtype}: --schedule auto "
                            "decides with a profile of the run's device and dtype")
    else:
        from .transplant import profile_for

        chosen, calibrated = profile_for(net, model, device, say=note)
    note(f"auto: deciding with {chosen}")
    return calibrated.hardware


def _write_traces(result, trace: Path | None, depth_trace: Path | None, *, model: str,
                  device: str, dtype: str, depth: int) -> None:
    """The run's call trace and depth trace, where asked for."""
    from costmodel.trace import TraceHeader, current_commit, write_jsonl

    header = dict(source="measured", model=model, device=str(device), dtype=dtype,
                  commit=current_commit(), depth=depth,
                  prompt_length=len(result.prompt), schedule=result.schedule,
                  extra={k: v for k, v in result.stats.items()
                         if k in ("draft_depth", "block_length", "width", "width_cap",
                                  "forced_acceptance", "mode", "attention_backend",
                                  "exit_rule", "mean_exit_depth")})
    if trace is not None:
        write_jsonl(trace, TraceHeader(trace="calls", **header), result.records)
    if depth_trace is not None:
        write_jsonl(depth_trace, TraceHeader(trace="depths", **header), result.depth_records)


def _report(result, tok, as_json: bool) -> None:
    """The tokens (text where there is a tokenizer) and the run's statistics: one JSON object,
    or the text on stdout and a summary line on stderr."""
    stats, n = result.stats, len(result.tokens)
    auto = stats.get("auto")
    if auto:
        by_depth = auto["acceptance_by_depth"]
        best = max(by_depth.items(), key=lambda kv: kv[1])
        d = stats.get("draft_depth")
        at_d = f"{by_depth[d]:.2f} at its draft depth, " if d in by_depth else ""
        typer.echo(f"auto: {auto['choice']} ({auto['flags']}): predicted "
                   f"{auto['predicted_tokens_per_s']:.1f} tokens/s, "
                   f"{auto['predicted_speedup_vs_ar']:.2f}x AR, with the prompt's acceptance "
                   f"{at_d}best {best[1]:.2f} at d = {best[0]}, on {auto['hardware']}", err=True)
    text = tok.decode(result.tokens) if tok is not None else None
    if as_json:
        print_json({
            "text": text, "tokens": result.tokens, "new_tokens": n, "wall_s": result.wall_s,
            "tokens_per_s": n / result.wall_s, "schedule": result.schedule,
            **result.call_stats(), **stats,
        })
        return
    typer.echo(text if text is not None else ",".join(map(str, result.tokens)))
    acceptance = stats.get("acceptance")
    typer.echo(f"[{result.schedule}] {n} tokens in {result.wall_s:.2f} s "
               f"({n / result.wall_s:.1f} tokens/s), {result.block_calls} block calls"
               + (f", acceptance {acceptance:.2f}" if acceptance is not None else "")
               + (f", exits by {stats['exit_rule']} at mean depth "
                  f"{stats['mean_exit_depth']:.2f}" if "exit_rule" in stats else "")
               + (", FORCED exits: not a real decode" if stats.get("forced_exits") else "")
               + (", FORCED acceptance: not a real decode"
                  if stats.get("forced_acceptance") else ""), err=True)


def _generate_file(net, tok, prompts_file: Path, out: Path | None, options, *, model: str,
                   device: str, trace: Path | None, as_json: bool, batch_size: int) -> None:
    """The batched path of ``generate``: every prompt of a JSON Lines file, B at a time, each
    result written as it finishes; bad lines are reported by number and skipped."""
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

    from costmodel.clitools import stderr_progress
    from costmodel.trace import TraceHeader, current_commit, write_jsonl

    from .batch import decode_batch
    from .prompts import OrderedWriter, read_prompts

    lines = read_prompts(prompts_file, tok, net.config, options.max_new_tokens)
    bad = [line for line in lines if line.request is None]
    for line in bad:
        typer.echo(f"skipped: {line.error}", err=True)
    requests = [line.request for line in lines if line.request is not None]
    if not requests:
        raise UserError(f"no usable prompt in {prompts_file}")
    stream = out.open("w") if out is not None else sys.stdout
    writer = OrderedWriter(lines, stream, tok)
    tokens = 0
    progress = stderr_progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[rate]}"))
    task = progress.add_task("decode", total=len(requests), rate="")
    started = time.perf_counter()

    def finished(result) -> None:
        nonlocal tokens
        writer.add(result)
        tokens += len(result.tokens)
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        progress.update(task, advance=1, rate=f"{rate:.1f} tokens/s")

    try:
        with progress:
            run = decode_batch(net, requests, options, batch_size=batch_size,
                               record=trace is not None, on_result=finished)
    finally:
        writer.close()
        if out is not None:
            stream.close()
    if trace is not None:
        write_jsonl(trace, TraceHeader(trace="calls", source="measured", model=model,
                                       device=device, dtype=options.dtype,
                                       commit=current_commit(), depth=run.stats["depth"],
                                       schedule=run.stats["schedule"],
                                       extra={"batch_size": run.stats["batch_size"]}),
                    run.records)
    _report_batch(run, len(lines), len(bad), as_json)
    if bad:
        raise typer.Exit(1)


def _report_batch(run, prompts: int, skipped: int, as_json: bool) -> None:
    """A batched run's totals: one JSON object, or a summary line on stderr."""
    totals = {"prompts": prompts, "served": len(run.results), "skipped": skipped,
              "new_tokens": run.tokens, "wall_s": run.wall_s,
              "tokens_per_s": run.tokens / run.wall_s, "prefill_s": run.prefill_s,
              "decode_tokens_per_s": run.decode_tokens_per_s, **run.stats}
    if as_json:
        print_json(totals)
        return
    typer.echo(f"[{run.stats['schedule']} x{run.stats['batch_size']}] {len(run.results)} "
               f"prompts, {run.tokens} tokens in {run.wall_s:.2f} s "
               f"({totals['tokens_per_s']:.1f} tokens/s), {run.stats['block_calls']} block "
               f"calls" + (f", {skipped} bad lines skipped" if skipped else ""), err=True)


main = run(app)
