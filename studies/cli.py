"""`costmodel study`: a design-space study's table and figure. Registered on the `costmodel`
app through the ``costmodel.commands`` entry point (pyproject.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from costmodel.cli import note_undetermined, undetermined
from costmodel.cli_options import JsonOption, note_machine
from costmodel.clitools import UserError, flush_notes, print_json, spinner, text_table
from costmodel.figures import NO_PLOTS
from costmodel.profile import load_profile

from . import STUDIES, run
from .common import cell, columns


def register(app: typer.Typer) -> None:
    """Add `study` to ``app``."""
    app.command("study")(study_cmd)


def study_cmd(
    name: Annotated[str, typer.Argument(help="study name, or 'list'")],
    profile: Annotated[Path | None, typer.Option(
        help="calibration profile whose hardware the study uses")] = None,
    out: Annotated[Path, typer.Option(help="folder for the table and figure")] = Path(
        "out/studies"),
    as_json: JsonOption = False,
) -> None:
    """Run a design-space study: writes NAME.csv, NAME.md and NAME.png into --out."""
    if name == "list":
        if as_json:
            print_json({"studies": list(STUDIES)})
        else:
            typer.echo("\n".join(STUDIES))
        return
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; the study writes its table and figure into a "
                        "folder")
    prof = load_profile(profile) if profile is not None else None
    if prof is not None:
        note_machine(prof, profile)
    hw = prof.hardware if prof is not None else None
    loose = undetermined(prof) if prof is not None else []
    with spinner(f"study {name}", disable=as_json):
        result, paths = run(name, profile=hw, out=out)
    flush_notes()
    if as_json:
        print_json({"name": name, "outputs": paths, "rows": result.rows, **result.summary,
                    "profile_undetermined": loose})
        return
    print_study(result, paths)
    if "figure" not in paths:
        typer.echo(NO_PLOTS, err=True)
    note_undetermined(loose)


def print_study(result, paths: dict[str, str], max_rows: int = 40) -> None:
    shown = result.rows[:max_rows]
    cols = columns(shown)
    words = tuple(i for i, col in enumerate(cols)
                  if any(isinstance(row.get(col), str) for row in shown))
    rows = [[cell(row.get(col)) for col in cols] for row in shown]
    typer.echo(text_table(cols, rows, left=words, title=result.title))
    if len(result.rows) > max_rows:
        typer.echo(f"... {len(result.rows) - max_rows} more rows in {paths['csv']}")
    typer.echo("wrote " + ", ".join(paths.values()))
