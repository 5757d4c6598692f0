"""The calls every schedule is made of: P, B and C over a list of positions, each timed and
recorded in the call trace (costmodel.trace.CallRecord), against one KV cache."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from costmodel.plans import call_slots
from costmodel.trace import CallRecord

from .cache import KVCache
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
               kv_sharing: int, readout_depths: Sequence[int], lookahead: int = 0) -> KVCache:
    """A cache for a prompt, its new tokens and the positions a schedule writes ahead."""
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
    return KVCache(prelude_layers=cfg.prelude_layers, core_layers=cfg.core_layers,
                   coda_layers=cfg.coda_layers, depth=depth, kv_sharing=kv_sharing,
                   readout_depths=list(readout_depths), kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, max_len=total + lookahead + 1, dtype=param.dtype,
                   device=param.device)


PROFILES_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"


def machine_name(device: str) -> str:
    """The CPU's or GPU's model name, as profiles record it."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


class Runner:
    """A model, its cache and the call trace of one generation."""

    def __init__(self, model: nn.Module, cache: KVCache, record: bool = True):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.timer = Timer(self.device)
        self.records: list[CallRecord] = []
        self.record = record

    def _log(self, kind: str, positions: list[int], depths: list[int], wall_s: float) -> None:
        if self.record:
            self.records.append(CallRecord(
                kind=kind, positions=list(positions), depths=list(depths),
                contexts=[p + 1 for p in positions],
                slots=call_slots(kind, depths, self.cache.kv_sharing), wall_s=wall_s))

    @torch.inference_mode()
    def prelude(self, tokens: list[int], positions: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(tokens, device=self.device)
        (e, state), wall = self.timer.measure(
            lambda: self.model.prelude(ids, positions, self.cache))
        self._log("prelude", positions, [0] * len(positions), wall)
        return e, state

    @torch.inference_mode()
    def block(self, state: torch.Tensor, e: torch.Tensor, positions: list[int],
              depths: list[int]) -> torch.Tensor:
        out, wall = self.timer.measure(
            lambda: self.model.block(state, e, positions, depths, self.cache))
        self._log("block", positions, depths, wall)
        return out

    @torch.inference_mode()
    def coda(self, state: torch.Tensor, positions: list[int],
             readout_depths: list[int]) -> torch.Tensor:
        logits, wall = self.timer.measure(
            lambda: self.model.coda(state, positions, readout_depths, self.cache))
        self._log("coda", positions, readout_depths, wall)
        return logits
