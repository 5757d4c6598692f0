"""The calls every schedule is made of: P, B and C over a list of positions, each timed and
recorded in the call trace (costmodel.trace.CallRecord), against one KV cache."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from costmodel.plans import call_slots
from costmodel.trace import CallRecord

from .cache import KVCache, part_slots
from .graphs import CallGraphs
from .layers import CallPlan, rope_frequencies
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
               sequences: int = 1) -> KVCache:
    """A static cache for a prompt, its new tokens and the positions a schedule writes ahead of
    the committed ones (a region of that length per sequence of a batch): exactly the sequences
    the cost model's memory model counts. A cache that does not fit beside the weights in the
    device's free memory is refused with the numbers."""
    cfg = model.config
    if depth < 1:
        raise GenerationError(f"depth must be at least 1, got {depth}")
    if kv_sharing < 0:
        raise GenerationError(f"KV sharing must be 0 or a slot count >= 1, got {kv_sharing}")
    total = prompt_len + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise GenerationError(f"a prompt of {prompt_len} tokens plus {max_new_tokens} new ones "
                              f"exceeds the model's context of {cfg.max_position_embeddings}")
    param = next(model.parameters())
    slots = part_slots(depth, kv_sharing, list(readout_depths))
    layer_slots = (cfg.prelude_layers * slots["prelude"] + cfg.core_layers * slots["block"]
                   + cfg.coda_layers * slots["coda"])
    per_position = 2 * layer_slots * cfg.num_kv_heads * cfg.head_dim * param.element_size()
    check_fits(sequences * (total + lookahead) * per_position, param.device,
               f"{sequences} sequence{'s' * (sequences > 1)} of {total + lookahead} positions",
               per_sequence_bytes=(total + lookahead) * per_position)
    return KVCache(prelude_layers=cfg.prelude_layers, core_layers=cfg.core_layers,
                   coda_layers=cfg.coda_layers, depth=depth, kv_sharing=kv_sharing,
                   readout_depths=list(readout_depths), kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, max_len=total + lookahead, dtype=param.dtype,
                   device=param.device, sequences=sequences)


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
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = meminfo_bytes("MemAvailable")
    return available if available is not None else (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_fits(kv_bytes: int, device: torch.device, what: str,
               per_sequence_bytes: int | None = None) -> None:
    """Refuse, before allocating, a KV cache larger than the device's free memory (the weights
    are already loaded there), saying how many such sequences would fit."""
    free = free_memory_bytes(device)
    if kv_bytes > free:
        room = (f"at most {free // per_sequence_bytes:,} such sequences fit"
                if per_sequence_bytes else "fewer sequences or shorter ones")
        raise GenerationError(f"the KV cache of {what} needs {kv_bytes / 1e9:.2f} GB and the "
                              f"{device.type} has {free / 1e9:.2f} GB free: {room}")


PROFILES_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"


def machine_name(device: str) -> str:
    """The GPU's model name, or the CPU's with the CPUs this process may use, as profiles
    record it."""
    from costmodel.profile import cpu_machine_name

    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return cpu_machine_name()


def machine_profile(family: str, device: str):
    """(path, profile): this machine's calibration profile for a model family in data/profiles/,
    the default grid's before the quick one's."""
    from costmodel.profile import ProfileError, load_profile

    here, kind = machine_name(device), "cuda" if device.startswith("cuda") else "cpu"
    paths = [p for p in PROFILES_DIR.glob(f"*{family}*.json")
             if not p.name.endswith(".validation.json")]  # reports beside the profiles
    for path in sorted(paths, key=lambda p: "quick" in p.name):
        try:
            profile = load_profile(path)
        except ProfileError:
            continue
        if profile.machine == here and profile.device.split(":")[0] == kind:
            return path, profile
    raise GenerationError(f"no calibration profile of {family} for this machine ({here}, {kind}) "
                          f"in {PROFILES_DIR}; make one with `costmodel calibrate --model "
                          f"{family}` and pass it with --profile")


MODES = ("eager", "static", "graphs")


def default_mode(device: torch.device | str) -> str:
    """graphs on CUDA, eager elsewhere."""
    return "graphs" if torch.device(device).type == "cuda" else "eager"


class Runner:
    """A model, its cache and the call trace of one generation.

    Modes: ``eager`` runs each call as it comes, attention reading the call's span of keys;
    ``static`` runs every call from static per-shape buffers with attention over the cache's
    static length (shapes fixed for the whole run); ``graphs`` is ``static`` with each shape
    captured once as a CUDA graph and replayed. All three execute the same model code."""

    def __init__(self, model: nn.Module, cache: KVCache, record: bool = True,
                 mode: str | None = None):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.mode = mode or default_mode(self.device)
        if self.mode not in MODES:
            raise GenerationError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        try:
            self.graphs = None if self.mode == "eager" else CallGraphs(self.mode == "graphs",
                                                                       self.device)
        except RuntimeError as exc:
            raise GenerationError(str(exc)) from None
        self.timer = Timer(self.device)
        self.records: list[CallRecord] = []
        self.record = record
        cfg = model.config
        self._frequencies = rope_frequencies(cfg.head_dim, cfg.rope_base, self.device)
        self._parts = {
            "prelude": lambda plan, ids: model.prelude(ids, plan, cache),
            "block": lambda plan, state, e: model.block(state, e, plan, cache),
            "coda": lambda plan, state: model.coda(state, plan, cache),
        }

    def _log(self, kind: str, positions: list[int], depths: list[int],
             sequences: list[int] | None, wall_s: float) -> None:
        if self.record:
            self.records.append(CallRecord(
                kind=kind, positions=list(positions), depths=list(depths),
                contexts=[p + 1 for p in positions],
                slots=call_slots(kind, depths, self.cache.kv_sharing),
                sequences=None if sequences is None else list(sequences), wall_s=wall_s))

    def run(self, kind: str, positions: list[int], depths: list[int],
            inputs: list[torch.Tensor], sequences: list[int] | None = None) -> torch.Tensor:
        """One call of a part over ``positions`` (of the given ``sequences`` of a batched cache,
        one per position): the prelude's injections, the block's new states, the coda's fp32
        logits."""
        slots = self.cache.slots(kind, depths, sequences)
        self.cache.claim(kind, slots, positions)
        part = self._parts[kind]
        if self.graphs is None:
            def call() -> torch.Tensor:
                pos = torch.tensor(positions, device=self.device)
                plan = CallPlan.make(pos, tuple(slots), torch.tensor(slots, device=self.device),
                                     self._frequencies, span=max(positions) + 1)
                return part(plan, *inputs)

            out, wall = self.timer.measure(call)
        else:
            static_slots, span = tuple(slots), self.cache.max_len

            def captured(pos, slot_index, *xs):
                plan = CallPlan.make(pos, static_slots, slot_index, self._frequencies, span=span)
                return part(plan, *xs)

            out, wall = self.graphs.run((kind, static_slots), captured,
                                        [torch.tensor(positions), torch.tensor(slots), *inputs],
                                        self.timer.measure)
        self._log(kind, positions, depths, sequences, wall)
        return out

    @torch.inference_mode()
    def prelude(self, tokens: list[int], positions: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(e, s_0) of each position: the injection and the initial state."""
        e = self.run("prelude", positions, [0] * len(positions),
                     [torch.tensor(tokens, device=self.device)])
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
        """Capture and warm-up time so far (static and graphs modes), excluded from run times."""
        return self.graphs.capture_s if self.graphs is not None else 0.0

    def mode_stats(self) -> dict[str, object]:
        """The mode, and in static and graphs modes the shapes prepared and the calls served."""
        stats: dict[str, object] = {"mode": self.mode}
        if self.graphs is not None:
            stats.update(self.graphs.stats())
        return stats
