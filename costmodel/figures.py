"""Figures, when matplotlib (the ``plots`` extra) is installed: drawn off-screen, written
atomically. Without it, nothing is written and the caller says so."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path


def save_figure(path: str | Path, draw: Callable[[object], None],
                size_in: tuple[float, float]) -> bool:
    """Draw with ``draw(figure)`` and write a PNG to ``path``; False without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from .trace import atomic_write

    fig = Figure(figsize=size_in, layout="constrained")
    draw(fig)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    atomic_write(path, png.getvalue())
    return True


NO_PLOTS = "note: no figure written (matplotlib is missing: pip install 'looped-decoding[plots]')"


def batch_speedup_axes(ax, title: str, ylabel: str, legend_size: int = 8) -> None:
    """Finish a speedup-against-batch plot: the 1x line, log2 batches, labels and legend."""
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per batch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)


def latency_against_rate(ax, points: dict[str, list[tuple[float, float, float]]], ylabel: str,
                         objective: float | None = None, title: str | None = None) -> None:
    """Latency against the request rate, a colour per schedule: ``points`` holds each
    schedule's (rate, p50, p99) triples (seconds), drawn in ms, p50 solid and p99 dotted; the
    objective (seconds) as a grey line; log2 rates."""
    for i, (name, triples) in enumerate(points.items()):
        rates, p50, p99 = zip(*triples, strict=True)
        ax.plot(rates, [t * 1e3 for t in p50], marker="o", color=f"C{i}", label=f"{name} p50")
        ax.plot(rates, [t * 1e3 for t in p99], linestyle=":", color=f"C{i}", label=f"{name} p99")
    if objective is not None:
        ax.axhline(objective * 1e3, color="grey", linewidth=0.8, label="objective")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request rate (/s)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
