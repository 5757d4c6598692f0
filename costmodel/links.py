"""Links between devices that run one model together (``costmodel.parallel``: tensor
parallelism; ``costmodel.placement``: parts on devices of their own): each link's bandwidth per
device in one direction and its time per collective (costmodel/data/links.json), and what T
devices over a link cost a call in collectives."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated

from pydantic import Field

from .model import LoopedModelSpec, PartSpec
from .specs import DTYPE_BYTES, Spec

LINKS_FILE = Path(__file__).resolve().parent / "data" / "links.json"


class Link(Spec):
    """What joins the devices: bandwidth per device in one direction, time per collective."""

    name: str
    bandwidth_bytes_per_s: Annotated[float, Field(gt=0)]
    latency_s: Annotated[float, Field(ge=0)]
    source: str | None = None


class TensorParallel(Spec):
    """T devices running one model's calls together, over ``link``."""

    degree: Annotated[int, Field(ge=2)]
    link: Link

    def all_reduce_s(self, size_bytes):
        t = self.degree
        return self.link.latency_s + 2 * (t - 1) / t * size_bytes / self.link.bandwidth_bytes_per_s

    def gather_s(self, size_bytes):
        t = self.degree
        return self.link.latency_s + (t - 1) / t * size_bytes / self.link.bandwidth_bytes_per_s

    def call_s(self, model: LoopedModelSpec, part: PartSpec, dtype: str, n_positions):
        """The collectives of one call of ``part`` over ``n_positions`` positions."""
        hidden = n_positions * model.hidden_size * DTYPE_BYTES[dtype]
        reduces = 2 * part.layers + (part.lookup_params > 0)  # + the split embedding's
        t = reduces * self.all_reduce_s(hidden)
        if part.name == "coda":  # the head's logits, fp32, gathered from every device
            t = t + self.gather_s(n_positions * model.vocab_size * model.tensor_parallel * 4)
        return t


@functools.cache
def _links() -> dict:
    return json.loads(LINKS_FILE.read_text())


def get_link(name: str) -> Link:
    links = _links()["links"]
    if name not in links:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(sorted(links))}")
    return Link(name=name, **links[name])


def default_link(hw) -> str:
    """The link a hardware's devices usually come with: a preset's (its name), a CPU's ranks'
    shared memory, else PCIe 4."""
    if hw.cpu is not None:
        return "cpu-shm"
    return _links()["defaults"].get(hw.name.rstrip("*"), "pcie4")


def resolve_link(hw, link: str | Link | None) -> Link:
    """The link ``link`` names (a name of links.json, a Link as it is, or None: the hardware's
    usual one)."""
    return link if isinstance(link, Link) else get_link(link or default_link(hw))
