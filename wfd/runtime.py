"""The calls every schedule is made of: P, B and C over a list of positions, each timed and
recorded in the call trace (costmodel.trace.CallRecord), against one KV cache."""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from costmodel.slots import call_slots, check_kv_sharing, keys_read, static_span
from costmodel.trace import CallRecord

from .cache import KVCache, part_slots
from .graphs import CallGraphs, Workspace, drop_workspaces, workspaces
from .layers import CallPlan, attention_policy, chosen_backend, rope_frequencies
from .sampling import GenerationError


class Timer:
    """Wall time of a call; on CUDA, events around the call, read after a synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], torch.Tensor]) -> tuple[object, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def make_cache(model: nn.Module, *, prompt_len: int, max_new_tokens: int, depth: int,
               kv_sharing: int, readout_depths: Sequence[int], lookahead: int = 0,
               sequences: int = 1, static: bool = False, exit_kv: str = "latest") -> KVCache:
    """A static cache for a prompt, its new tokens and the positions a schedule writes ahead of
    the committed ones (a region of that length per sequence of a batch): exactly the sequences
    the cost model's memory model counts, rounded up to whole static spans when ``static`` (the
    longest span a static call reads, costmodel.slots.static_span). A cache that does not fit
    beside the weights in the device's free memory is refused with the numbers."""
    cfg = model.config
    check_run(model, prompt_len, max_new_tokens, depth, kv_sharing)
    total = prompt_len + max_new_tokens
    length = static_span(total + lookahead) if static else total + lookahead
    param = next(model.parameters())
    slots = part_slots(depth, kv_sharing, list(readout_depths), exit_kv)
    layer_slots = (cfg.prelude_layers * slots["prelude"] + cfg.core_layers * slots["block"]
                   + cfg.coda_layers * slots["coda"])
    per_position = 2 * layer_slots * cfg.num_kv_heads * cfg.head_dim * param.element_size()
    check_fits(sequences * length * per_position, param.device,
               f"{sequences} sequence{'s' * (sequences > 1)} of {length} positions",
               per_sequence_bytes=length * per_position, per_position_bytes=per_position)
    return KVCache(prelude_layers=cfg.prelude_layers, core_layers=cfg.core_layers,
                   coda_layers=cfg.coda_layers, depth=depth, kv_sharing=kv_sharing,
                   readout_depths=list(readout_depths), kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, max_len=length, dtype=param.dtype,
                   device=param.device, sequences=sequences, exit_kv=exit_kv)


def check_prompt(prompt: object, vocab_size: int, what: str = "the prompt") -> None:
    """Refuse a prompt that is not token ids of the vocabulary, in one line (text is encoded by
    a tokenizer first: wfd.tokenizer.tokenizer_for)."""
    if isinstance(prompt, str | bytes) or not all(  # numpy's integers are Integral too
            isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in prompt):
        raise GenerationError(f"{what} must be token ids (integers); encode text first")
    if not prompt:
        raise GenerationError(f"{what} is empty")
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise GenerationError(f"{what} holds token id {bad[0]}, outside the vocabulary of "
                              f"{vocab_size}")


def check_run(model: nn.Module, prompt_len: int, max_new_tokens: int, depth: int,
              kv_sharing: int) -> None:
    """Refuse a depth, a sharing or a sequence the model cannot run, in one line."""
    if depth < 1:
        raise GenerationError(f"depth must be at least 1, got {depth}")
    check_kv_sharing(kv_sharing, depth)
    check_length(prompt_len, max_new_tokens, model.config.max_position_embeddings)


def check_length(prompt_len: int, max_new_tokens: int, context: int) -> None:
    if prompt_len + max_new_tokens > context:
        raise GenerationError(f"a prompt of {prompt_len} tokens plus {max_new_tokens} new ones "
                              f"exceeds the model's context of {context}")


def runner_for(model: nn.Module, *, mode: str | None = None, record: bool = True,
               **cache: object) -> Runner:
    """A runner for one run (``cache``: make_cache's arguments). Eager: a cache of its own.
    Static and graphs: the model's workspace for this cache layout (wfd.graphs), its cache and
    the shapes already prepared on it reused; a run that needs a longer cache replaces it, and a
    cache that does not fit beside the model's other workspaces frees them first."""
    device = next(model.parameters()).device
    mode = mode or default_mode(device)
    if mode not in MODES:
        raise GenerationError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "eager":
        return Runner(model, make_cache(model, **cache), record=record, mode=mode)
    layout = (mode, cache["depth"], cache["kv_sharing"],
              tuple(sorted(set(cache["readout_depths"]))), cache.get("sequences", 1),
              cache.get("exit_kv", "latest"))
    spaces = workspaces(model)
    space = spaces.get(layout)
    needed = static_span(cache["prompt_len"] + cache["max_new_tokens"]
                         + cache.get("lookahead", 0))
    if space is not None and space.cache.max_len >= needed:
        check_run(model, cache["prompt_len"], cache["max_new_tokens"], cache["depth"],
                  cache["kv_sharing"])
        space.cache.reset()
    else:
        graphs = CallGraphs(mode == "graphs", device)
        if space is not None:  # too short: its cache and shapes go
            drop_workspaces(model, [layout])
        try:
            new = make_cache(model, static=True, **cache)
        except GenerationError:
            if not spaces:
                raise
            drop_workspaces(model)  # the other layouts' caches make room, or the error stands
            new = make_cache(model, static=True, **cache)
        space = spaces[layout] = Workspace(new, graphs)
    return Runner(model, space.cache, record=record, mode=mode, graphs=space.graphs)


def meminfo_bytes(field: str) -> int | None:
    """A field of the host's /proc/meminfo (MemTotal, MemAvailable) in bytes; None without it."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info[field].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":  # and what torch's allocator holds unused, free to it
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    available = meminfo_bytes("MemAvailable")
    return available if available is not None else (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_fits(kv_bytes: int, device: torch.device, what: str,
               per_sequence_bytes: int | None = None, per_position_bytes: int | None = None
               ) -> None:
    """Refuse, before allocating, a KV cache larger than the device's free memory (the weights
    are already loaded there), saying how many such sequences would fit, or where not one
    does, how many positions of one."""
    free = free_memory_bytes(device)
    if kv_bytes > free:
        if per_sequence_bytes and free >= per_sequence_bytes:
            room = f"at most {free // per_sequence_bytes:,} such sequences fit"
        elif per_position_bytes:
            room = f"one sequence fits at most {free // per_position_bytes:,} positions"
        else:
            room = "fewer sequences or shorter ones"
        raise GenerationError(f"the KV cache of {what} needs {kv_bytes / 1e9:.2f} GB and the "
                              f"{device.type} has {free / 1e9:.2f} GB free: {room}")


def machine_name(device: str) -> str:
    """The GPU's model name, or the CPU's with the CPUs this process may use, as profiles
    record it (costmodel.store)."""
    from costmodel.store import cpu_machine_name

    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return cpu_machine_name()


MODES = ("eager", "static", "graphs")


def default_mode(device: torch.device | str) -> str:
    """graphs on CUDA, eager elsewhere."""
    return "graphs" if torch.device(device).type == "cuda" else "eager"


class Runner:
    """A model, its cache and the call trace of one generation.

    Modes: ``eager`` runs each call as it comes, attention reading the call's span of keys;
    ``static`` runs every call from static per-shape buffers with attention over a static span
    (the position's rounded up to whole blocks, the masks hiding the keys after each position);
    ``graphs`` is ``static`` with each shape captured once as a CUDA graph and replayed. All
    three execute the same model code, under the device's attention policy
    (wfd.layers.attention_policy). ``graphs``: the workspace's shapes (wfd.graphs; runner_for)."""

    def __init__(self, model: nn.Module, cache: KVCache, record: bool = True,
                 mode: str | None = None, graphs: CallGraphs | None = None):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.mode = mode or default_mode(self.device)
        if self.mode not in MODES:
            raise GenerationError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode != "eager" and graphs is None:
            graphs = CallGraphs(self.mode == "graphs", self.device)
        self.graphs = None if self.mode == "eager" else graphs
        self.usage = self.graphs.start_run() if self.graphs is not None else None
        self.timer = Timer(self.device)
        self.records: list[CallRecord] = []
        self.record = record
        # call kind -> the slots and span of its first decode call, or of its prefill call
        # until one comes (the attention kernel it runs is looked up from these when reported,
        # off the calls' path), and whether they are the prefill's
        self.first_shapes: dict[str, tuple[list[int], int, bool]] = {}
        cfg = model.config
        self._frequencies = rope_frequencies(cfg.head_dim, cfg.rope_base, self.device)
        self._parts = {
            "prelude": lambda plan, ids: model.prelude(ids, plan, cache),
            "block": lambda plan, state, e: model.block(state, e, plan, cache),
            "coda": lambda plan, state: model.coda(state, plan, cache),
        }

    def _log(self, kind: str, positions: list[int], depths: list[int],
             sequences: list[int] | None, wall_s: float, static: bool) -> None:
        if self.record:
            self.records.append(CallRecord(
                kind=kind, positions=list(positions), depths=list(depths),
                contexts=keys_read(positions, static),
                slots=call_slots(kind, depths, self.cache.kv_sharing),
                sequences=None if sequences is None else list(sequences), wall_s=wall_s))

    def run(self, kind: str, positions: list[int], depths: list[int],
            inputs: list[torch.Tensor], sequences: list[int] | None = None,
            tokens: list[int] | None = None, prefill: bool = False) -> torch.Tensor:
        """One call of a part over ``positions`` (of the given ``sequences`` of a batched cache,
        one per position): the prelude's injections (of ``tokens``), the block's new states, the
        coda's fp32 logits. A ``prefill`` call runs eagerly in every mode: a prompt's few calls
        read the weights once for all its positions, so a graph would save nothing, and each
        prompt length would be a shape of its own."""
        slots = self.cache.slots(kind, depths, sequences)
        self.cache.claim(kind, slots, positions)
        part = self._parts[kind]
        static = self.graphs is not None and not prefill
        span = static_span(max(positions) + 1) if static else max(positions) + 1
        if self.first_shapes.get(kind, (None, None, True))[2]:
            self.first_shapes[kind] = (slots, span, prefill)
        # the reference exit rule's absent keys, masked in the core's attention
        presence = self.cache.presence if kind == "block" else None
        if not static:
            def call() -> torch.Tensor:
                with attention_policy(self.device):
                    pos = torch.tensor(positions, device=self.device)
                    plan = CallPlan.make(pos, tuple(slots), torch.tensor(slots, device=self.device),
                                         self._frequencies, span=span, presence=presence)
                    ids = [] if tokens is None else [torch.tensor(tokens, device=self.device)]
                    return part(plan, *ids, *inputs)

            out, wall = self.timer.measure(call)
        else:
            n, static_slots, device = len(positions), tuple(slots), self.device
            embeds = tokens is not None

            # kept with the shape and replayed by later runs: it reads nothing but its
            # arguments, the model and the workspace's cache (not this runner's state)
            def captured(ints, slot_index, frequencies, *xs):
                with attention_policy(device):
                    plan = CallPlan.make(ints[:n], static_slots, slot_index, frequencies,
                                         span=span, presence=presence)
                    return part(plan, *([ints[n:]] if embeds else []), *xs)

            out, wall = self.graphs.run(
                (kind, static_slots, span), captured, [*positions, *(tokens or ())], inputs,
                self.timer.measure,
                constants=lambda: [torch.tensor(slots, device=device), self._frequencies])
        self._log(kind, positions, depths, sequences, wall, static)
        return out

    @torch.inference_mode()
    def prelude(self, tokens: list[int], positions: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(e, s_0) of each position: the injection and the initial state."""
        e = self.run("prelude", positions, [0] * len(positions), [], tokens=tokens)
        return e, self.model.initial_state(positions, e)

    @torch.inference_mode()
    def block(self, state: torch.Tensor, e: torch.Tensor, positions: list[int],
              depths: list[int]) -> torch.Tensor:
        return self.run("block", positions, depths, [state, e])

    @torch.inference_mode()
    def coda(self, state: torch.Tensor, positions: list[int],
             readout_depths: list[int]) -> torch.Tensor:
        return self.run("coda", positions, readout_depths, [state])

    @property
    def capture_s(self) -> float:
        """This run's capture and warm-up time so far (static and graphs modes), excluded from
        run times."""
        return self.usage.capture_s if self.usage is not None else 0.0

    def mode_stats(self) -> dict[str, object]:
        """The mode, the attention kernel of each call kind (its decode calls', the prefill's
        where it made none), and in static and graphs modes the
        shapes this run used (prepared by it, or reused from an earlier run), the calls served
        and the seconds preparing took."""
        backends = {kind: chosen_backend(self.model, kind, slots, span)
                    for kind, (slots, span, _) in self.first_shapes.items()}
        stats: dict[str, object] = {"mode": self.mode, "attention_backend": backends}
        if self.usage is not None:
            stats.update(self.usage.stats())
        return stats
