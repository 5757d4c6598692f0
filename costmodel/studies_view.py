"""Printing a study's table in the terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def print_study(result, paths: dict[str, str], max_rows: int = 40) -> None:
    console = Console(width=max(Console().width, 132))
    table = Table(title=result.title, header_style="bold")
    for col in result.rows[0]:
        table.add_column(col)
    for row in result.rows[:max_rows]:
        table.add_row(*(_cell(v) for v in row.values()))
    console.print(table)
    if len(result.rows) > max_rows:
        console.print(f"... {len(result.rows) - max_rows} more rows in {paths['csv']}")
    console.print("wrote " + ", ".join(paths.values()))
