"""`costmodel`'s profile commands: calibrate, validate, check-profile, join-modes, refit,
upgrade-profile. Registered on the `costmodel` app through the ``costmodel.commands`` entry
point (pyproject.toml); torch, rich and the decoder are imported inside each command."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated

import typer

from costmodel.cli import app, run_app, undetermined
from costmodel.cli_options import JsonOption
from costmodel.clitools import (
    DTYPES,
    UserError,
    check_writable,
    error_summary,
    one_of,
    print_json,
    stderr_progress,
    text_table,
)
from costmodel.figures import NO_PLOTS
from costmodel.profile import load_profile, save_profile


def fit_json(profile) -> dict:
    """What the profile commands' --json says of a fit: its coefficients, what it held, its
    statistics and its cross-mode checks."""
    return {"coefficients": {k: v.model_dump() for k, v in profile.coefficients.items()},
            "held": {k: v.model_dump() for k, v in profile.held.items()},
            "fit_stats": profile.fit_stats,
            "cross_mode": [c.model_dump() for c in profile.cross_mode]}


def register(app: typer.Typer) -> None:
    """Add the profile commands to ``app``."""
    for name, command in (("calibrate", calibrate_cmd), ("validate", validate_cmd),
                          ("check-profile", check_profile_cmd), ("join-modes", join_modes_cmd),
                          ("refit", refit_cmd), ("upgrade-profile", upgrade_profile_cmd)):
        app.command(name)(command)


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
    retries: Annotated[int | None, typer.Option(
        help="times a measurement is taken again when the canary product around it ran slow "
             "(another tenant's load; default 4 on a CPU, 0 on a GPU)")] = None,
    as_json: JsonOption = False,
) -> None:
    """Measure the decoder on this machine, fit the cost model, validate on held-out points and
    save a versioned profile."""
    if one_of("mode", mode, ("eager", "graphs")) == "graphs" and not device.startswith("cuda"):
        raise UserError("--mode graphs captures CUDA graphs: it needs --device cuda")
    one_of("model family", model, ("huginn", "ouro"))
    one_of("dtype", dtype, DTYPES)
    one_of("device", device.split(":")[0], ("cpu", "cuda"))
    if threads is not None and threads < 1:
        raise UserError(f"--threads must be at least 1, got {threads}")
    if retries is not None and retries < 0:
        raise UserError(f"--retries must be at least 0, got {retries}")
    if checkpoint is not None and not checkpoint.is_dir():
        raise UserError(f"checkpoint {checkpoint} is not a folder")
    alphas = parse_acceptances(acceptances) if acceptances is not None else None
    out = out or Path(f"out/profile-{model}-{device.split(':')[0]}-{dtype}.json")
    check_writable(out)
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} is not available (torch sees no CUDA device)")
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from calibrate.run import calibrate, too_busy
    from calibrate.validate import report

    with stderr_progress(TextColumn("{task.description}"), BarColumn(),
                         TimeElapsedColumn()) as progress:  # a CheckpointError: run's line
        profile = calibrate(model, checkpoint=str(checkpoint) if checkpoint else None,
                            device=device, dtype=dtype, quick=quick, threads=threads,
                            fit_models=fit_models.split(",") if fit_models else None,
                            holdout_model=holdout_model, mode=mode, progress=progress,
                            machine_from=machine_from, force=force, acceptances=alphas,
                            retries=retries)
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


def _print_validation(profile, rep, path: Path, plot_path: Path | None, as_json: bool) -> None:
    if as_json:
        print_json({"profile": str(path), "plot": str(plot_path) if plot_path else None,
                    "machine": profile.machine,
                    **fit_json(profile), "checks": profile.checks,
                    "load": profile.load.model_dump() if profile.load else None,
                    **rep.model_dump()})
        return
    _print_fit(profile)
    _print_held_out_errors(rep)
    _print_errors_by_mode(profile, rep)
    typer.echo(f"profile: {path}" + (f"; plot: {plot_path}" if plot_path else ""))


def _print_fit(profile) -> None:
    """The fitted and held coefficients, what the calibration checked and how busy the machine
    was."""
    threads = f", {profile.threads} threads" if profile.threads else ""
    rows = [[name, f"{v.value:.4g}", "measured" if v.unit.endswith("(measured)")
             else f"{v.stderr:.2g}", v.unit.removesuffix(" (measured)")]
            for name, v in profile.coefficients.items()]
    rows += [[name, f"{v.value:.4g}", "-", v.reason] for name, v in profile.held.items()]
    typer.echo(text_table(["coefficient", "value", "std. error", "unit"], rows, left=(0, 3),
                          title=f"fitted on {profile.machine} ({profile.device}, "
                                f"{profile.dtype}{threads})"))
    for check in profile.checks:
        typer.echo(f"checked: {check}")
    if profile.load is not None:
        load = profile.load
        typer.echo(f"load: {load.measurements} measurements, {load.retaken_fraction:.0%} "
                   f"taken again, {load.loaded_fraction:.0%} kept with the canary over "
                   f"{load.canary_tolerance}x (median {load.canary_median:.2f}x, 90th "
                   f"percentile {load.canary_p90:.2f}x"
                   + (f", spread {load.canary_p90 / load.canary_p10:.2f}x: 90th over 10th"
                      if load.canary_p10 else "") + ")"
                   + (": written with --force, too busy to trust" if load.forced else ""))


def _rel_errors(stats) -> list[str]:
    """A group's median and max |relative error|."""
    return [f"{stats['median_rel_error']:.1%}", f"{stats['max_rel_error']:.1%}"]


def _print_held_out_errors(rep) -> None:
    """The held-out points' errors by schedule, in all and per calibration target, and the
    noise floor under them (each point's spread over its measurements)."""
    from calibrate.validate import FIGURES

    def errors(group: str, points: int, stats) -> list[str]:
        return [group, str(points), *_rel_errors(stats)]

    rows = [errors(group, int(stats["points"]), stats)
            for group, stats in rep.per_schedule.items()]
    rows.append(errors("all", len(rep.points), {"median_rel_error": rep.median_rel_error,
                                                "max_rel_error": rep.max_rel_error}))
    # the calibration targets' two figures: per call, and per decoded token of the runs
    rows += [errors(f"{kind}s" + (", per token" if kind == "run" else ""),
                    int(stats["points"]), stats)
             for figure, kind in FIGURES if (stats := getattr(rep, figure))]
    typer.echo(text_table(["group", "points", "median |rel. error|", "max |rel. error|"], rows,
                          title="held-out validation"))
    spreads = [(f"{kind}s", s) for figure, kind in FIGURES
               if (s := rep.repeat_spread.get(figure))]
    if spreads:
        typer.echo("each held-out point measured again: its slowest over its fastest "
                   "measurement, less 1, is " + " and ".join(
                       f"{s['median_spread']:.1%} for the {what} (median; max "
                       f"{s['max_spread']:.1%})" for what, s in spreads)
                   + ". Errors near these are the machine's noise in that hour, not the "
                   "model's.")


def _print_errors_by_mode(profile, rep) -> None:
    """Errors by execution mode: of the fit on every mode, and of a fit on one mode pricing
    another (the profile's cross-mode checks); nothing when there are neither."""

    def cells(*figures) -> list[str]:
        return [" / ".join(_rel_errors(f)) if f else "-" for f in figures]

    if rep.per_mode or profile.cross_mode:
        rows = [["both", mode, *cells(stats["per_call"], stats["per_token"])]
                for mode, stats in rep.per_mode.items()]
        rows += [[f"{check.fit_on} only", check.predicted, *cells(check.per_call,
                                                                  check.per_token)]
                 for check in profile.cross_mode]
        typer.echo(text_table(["fitted on", "priced", "calls", "runs, per token"], rows,
                              left=(0, 1), title="by execution mode (median / max |rel. error|)"))


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


def check_profile_cmd(
    profile: Annotated[Path, typer.Option(help="calibration profile (JSON)")],
    calls: Annotated[int, typer.Option(
        help="how many of the profile's calls to time again (spread over its models)")] = 16,
    retries: Annotated[int, typer.Option(
        help="times a call timed while the machine was busy is timed again, after a pause "
             "(0: time each once, the quickest check)")] = 4,
    as_json: JsonOption = False,
) -> None:
    """Time a sample of the profile's calls on this machine and compare them with the times it
    stored: does it still price this machine? Exit 1 when it does not (recalibrate)."""
    prof = load_profile(profile)
    if calls < 1:
        raise UserError(f"--calls must be at least 1, got {calls}")
    if retries < 0:
        raise UserError(f"--retries must be at least 0, got {retries}")
    if prof.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"profile {profile} was measured on {prof.device} "
                            f"({prof.machine}); this machine has no CUDA device")
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from calibrate.check import call_points, check_profile
    from wfd.checkpoint import CheckpointError

    points = call_points(prof)
    if not points:
        raise UserError(f"profile {profile} holds no calls to time again")
    try:
        with stderr_progress(TextColumn("{task.description}"), BarColumn(),
                             TimeElapsedColumn()) as progress:
            check = check_profile(prof, calls, progress, retries)
    except CheckpointError as exc:
        raise UserError(f"profile {profile}: {exc}") from None
    ratio, per_model = check.median_ratio, check.per_model()
    if as_json:
        print_json({"profile": str(profile), **check.model_dump(), "median_ratio": ratio,
                    "holds": check.holds,
                    "per_model": {m: statistics.median(r) for m, r in per_model.items()},
                    "ratios": [c.ratio for c in check.calls]})
    else:
        threads = f", {check.threads} threads" if check.threads else ""
        rows = [[model, str(len(ratios)), f"{statistics.median(ratios):.2f}x",
                 f"{min(ratios):.2f}-{max(ratios):.2f}x"]
                for model, ratios in [*per_model.items(), ("all", [c.ratio for c in check.calls])]]
        typer.echo(text_table(["model", "calls", "time now / profile's (median)", "range"], rows,
                              title=f"{profile} ({prof.created[:10]}, {check.profile_machine}) "
                                    f"on this machine ({check.machine}{threads})"))
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
        print_json({"profile": str(out), **fit_json(joint)})
        return
    typer.echo(f"{out}: {int(joint.fit_stats['train_points'])} calls of both modes fitted"
               + (f"; held: {', '.join(joint.held)}" if joint.held else ""))
    for check in joint.cross_mode:
        typer.echo(f"fitted on {check.fit_on} only, priced {check.predicted}: "
                   + error_summary((("calls", check.per_call), ("per token", check.per_token))))


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
        print_json({"profile": str(out), **fit_json(after),
                    **{label: None if rep is None else {"per_call": rep.per_call,
                                                        "per_token": rep.per_token}
                       for label, rep in reports.items()}})
        return
    typer.echo(f"{out}: {int(after.fit_stats['train_points'])} training calls refitted"
               + (f"; held: {', '.join(after.held)}" if after.held else ""))
    for label, rep in reports.items():
        if rep is None:
            continue
        typer.echo(f"held-out, {label}: "
                   + error_summary((("calls", rep.per_call), ("per token", rep.per_token))))


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
    loose = undetermined(prof)
    typer.echo(f"{target}: schema {before} -> {prof.schema_version}"
               + (f"; held at priors: {', '.join(loose)}" if loose else ""))


if __name__ == "__main__":  # `python -m calibrate.cli`: a checkout not installed (calibrate/gpu.sh)
    register(app)
    run_app()
