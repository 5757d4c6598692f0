"""Tensor parallelism: a model's layers split over T devices joined by a link, as vLLM splits
them (the plugin's layers are vLLM's parallel layers).

Each device holds 1/T of every attention layer's heads (its KV heads too, or one of them where
there are fewer KV heads than devices), 1/T of every MLP's intermediate rows and 1/T of the
vocabulary (embedding and head); norms and Huginn's adapter are whole on every device. A call
of a part then costs each device the call of its share (``shard``: the model one device holds,
priced by the same call cost) plus the collectives that join the shares, over the link:

    all-reduce of b bytes:  latency + 2 (T - 1) / T * b / bandwidth     (ring)
    gather of b bytes:      latency + (T - 1) / T * b / bandwidth

one all-reduce of the hidden states after each attention and each MLP block, one after the
prelude's embedding lookup (its vocabulary is split), and a gather of the logits after the head.
A collective's latency is the link's fixed time per collective (its launch and synchronization),
its bandwidth the link's in one direction per device.
"""

from __future__ import annotations

from .hardware import HardwareSpec
from .links import Link, TensorParallel, resolve_link
from .model import LoopedModelSpec

MOST_DEGREES = 64  # the degrees listed when one is refused


def degree_works(model: LoopedModelSpec, degree: int) -> bool:
    """Whether vLLM can split ``model`` over ``degree`` devices: its heads, its KV heads (or
    the devices over them: KV heads repeated) and its MLP rows divide evenly."""
    kv = model.num_kv_heads
    return (model.num_heads % degree == 0 and model.mlp_size % degree == 0
            and (kv % degree == 0 or degree % kv == 0))


def working_degrees(model: LoopedModelSpec, most: int = MOST_DEGREES) -> list[int]:
    return [t for t in range(1, most + 1) if degree_works(model, t)]


def check_degree(model: LoopedModelSpec, degree: int) -> None:
    """Refuse, in one line naming the degrees that work, a split the model's shapes forbid."""
    if degree < 1:
        raise ValueError(f"tensor parallel degree must be at least 1, got {degree}")
    if not degree_works(model, degree):
        raise ValueError(
            f"{model.name} cannot be split over {degree} devices: its {model.num_heads} heads "
            f"({model.num_kv_heads} KV heads) and MLP of {model.mlp_size} rows must divide "
            f"evenly; degrees that work: "
            f"{', '.join(map(str, working_degrees(model)))}")


def shard(model: LoopedModelSpec, degree: int) -> LoopedModelSpec:
    """The share of ``model`` one of ``degree`` devices holds (itself at 1, or if already
    split so)."""
    if degree == model.tensor_parallel:
        return model
    if model.tensor_parallel != 1:
        raise ValueError(f"{model.name} is already split over {model.tensor_parallel} devices")
    check_degree(model, degree)
    return model.model_copy(update={
        "num_heads": model.num_heads // degree,
        "num_kv_heads": max(1, model.num_kv_heads // degree),
        "mlp_size": model.mlp_size // degree,
        "vocab_size": -(-model.vocab_size // degree),
        "tensor_parallel": degree})


def split(model: LoopedModelSpec, hw: HardwareSpec, degree: int = 1,
          link: str | Link | None = None) -> tuple[LoopedModelSpec, HardwareSpec]:
    """``model`` over ``degree`` devices of ``hw`` joined by ``link`` (a name, a Link, or None:
    the hardware's usual one): one device's share of the model, and the hardware pricing it
    with the link's collectives. A CPU's ranks share its cores and memory, each one 1/T of
    them: its bandwidth, flops and products at 1/T of the speed, its capacity 1/T (its host's
    work runs on each rank's own core, at the same speed)."""
    if degree == 1 and link is None:
        return model, hw
    if degree == 1:
        raise ValueError("a link joins several devices: give --tensor-parallel 2 or more")
    if hw.tensor_parallel is not None:
        raise ValueError(f"{hw.name} is already {hw.tensor_parallel.degree} devices")
    chosen = resolve_link(hw, link)
    device = hw
    if hw.cpu is not None:
        device = hw.with_device_speed(1 / degree).with_terms(
            memory_capacity_bytes=hw.roofline.memory_capacity_bytes / degree)
    return shard(model, degree), device.with_terms(
        tensor_parallel=TensorParallel(degree=degree, link=chosen))


def devices_text(hw: HardwareSpec) -> str:
    """The hardware's name, with its devices and their link where they are several."""
    tp = hw.tensor_parallel
    if tp is None:
        return hw.name
    return (f"{tp.degree} x {hw.name} over {tp.link.name} "
            f"({tp.link.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
            f"{tp.link.latency_s * 1e6:.0f} us a collective)")
