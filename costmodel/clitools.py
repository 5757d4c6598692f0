"""What both command lines share: one-line errors with exit code 2, and JSON printing."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from pydantic import ValidationError

from .errors import validation_message

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import ClickException
    from click.exceptions import UsageError as NoArgsIsHelpError


class UserError(Exception):
    """Bad input: printed as one line on stderr, exit code 2."""


DTYPES = ("fp32", "bf16", "fp16")


def one_of(what: str, value: str, choices: tuple[str, ...]) -> str:
    """``value``, or a UserError naming the choices: "unknown dtype 'x'; use fp32, bf16 or
    fp16"."""
    if value not in choices:
        raise UserError(f"unknown {what} {value!r}; use {', '.join(choices[:-1])} or "
                        f"{choices[-1]}")
    return value


# The install extra that brings each optional package (pyproject.toml).
EXTRAS = {"torch": "decoder", "safetensors": "decoder", "tokenizers": "decoder",
          "scipy": "calibrate", "matplotlib": "plots"}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one-line message for a command that needs an extra that is not installed."""
    package = (exc.name or "").split(".")[0]
    if package not in EXTRAS:
        return None
    extra = EXTRAS[package]
    return (f"this command needs {package}, which is not installed: "
            f"pip install 'looped-decoding[{extra}]'")


_NOTES: list[str] = []


def note(line: str) -> None:
    """A note on stderr about how the command runs (a profile made on another machine, one
    rescaled to this one): held until the command has checked its input and goes on
    (``flush_notes``, or its end), dropped if it refuses the input, whose one line then stands
    alone."""
    _NOTES.append(line)


def flush_notes() -> None:
    """Print the notes held so far: the command has checked its input and goes on."""
    while _NOTES:
        typer.echo(_NOTES.pop(0), err=True)


def run(app: typer.Typer, user_errors: tuple[type[BaseException], ...] = ()) -> Callable[[], None]:
    """Entry point for ``app`` that turns usage errors and bad input into one line and exit 2
    (the notes held then dropped: ``note``)."""

    def main() -> None:
        _NOTES.clear()
        code = outcome()
        if code == 2:  # refused: its one line alone
            _NOTES.clear()
        flush_notes()
        sys.exit(code)

    def outcome() -> int:
        """The command's exit code, its error's one line printed."""
        try:
            code = app(standalone_mode=False)
            return code if isinstance(code, int) else 0
        except typer.Exit as exc:
            return exc.exit_code
        except typer.Abort:
            return 130
        except NoArgsIsHelpError as exc:
            typer.echo(exc.format_message(), err=True)
            return 2
        except ClickException as exc:  # a usage error's code is 2
            typer.echo(f"error: {exc.format_message()}", err=True)
            return exc.exit_code
        except ModuleNotFoundError as exc:
            message = missing_extra(exc)
            if message is None:
                raise
        except (UserError, ValueError, OSError, *user_errors) as exc:
            message = error_text(exc)
        typer.echo(f"error: {message}", err=True)
        return 2

    return main


def error_text(exc: BaseException) -> str:
    """Bad input's one line (a pydantic model's refusal as ``validation_message`` words it); a
    file that cannot be read or written by its name and why."""
    if isinstance(exc, ValidationError):
        return validation_message(exc)
    if not isinstance(exc, OSError):
        return str(exc)
    named = exc.filename and str(exc.filename) not in str(exc.strerror)
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if named else "")


def script_main(main: Callable[[], object]) -> None:
    """A script's entry (bench/): bad input, a missing file or preset as one line on stderr and
    exit 2, as the command lines report them, instead of a traceback."""
    from .presets import UnknownPresetError

    try:
        main()
    except (UserError, ValueError, OSError, UnknownPresetError) as exc:
        print(f"error: {error_text(exc)}", file=sys.stderr)
        sys.exit(2)


def check_writable(*paths) -> None:
    """Each path given (None: skipped) can be written, its folder made if need be: asked before
    a command spends minutes on what it would write there."""
    import os
    from pathlib import Path

    for path in (Path(p) for p in paths if p is not None):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror}") from None
        if not os.access(path.parent, os.W_OK):
            raise UserError(f"cannot write {path}: its folder is not writable")


def print_json(payload: object) -> None:
    typer.echo(json.dumps(payload, indent=2))


def text_table(headers: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,),
               title: str | None = None) -> str:
    """Columns aligned in plain text (the ``left`` ones to the left, the rest to the right),
    under a rule: a query's table without rich's machinery on its path."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    body = [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    return "\n".join(([title] if title else []) + body)


def stderr_progress(*columns):
    """A transient rich progress display of ``columns`` on stderr (stdout carries the command's
    output), drawn on a terminal only: elsewhere rich would leave a blank line before an error's
    one line."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)


@contextmanager
def spinner(description: str, disable: bool = False) -> Iterator[None]:
    """A transient spinner with the elapsed time, for a step that takes seconds and has no
    count to show (rich imported only when it spins: the CLI starts fast)."""
    if disable:
        yield
        return
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with stderr_progress(SpinnerColumn(), TextColumn("{task.description}"),
                         TimeElapsedColumn()) as progress:
        progress.add_task(description, total=None)
        yield


def error_summary(figures) -> str:
    """"calls median 3.1%, max 8.0%; per token median ..." for (label, statistics) pairs, those
    without statistics left out: how a profile command reports held-out errors in one line."""
    return "; ".join(f"{label} median {s['median_rel_error']:.1%}, max {s['max_rel_error']:.1%}"
                     for label, s in figures if s)
