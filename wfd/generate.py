"""Autoregressive decoding of a looped LM, with the call trace and the depth trace.

    prefill: P over the prompt, R block calls over all its positions, C at each readout depth
    per token: P, R block calls (one position), C at depth R

With ``depth_trace`` the coda also reads every position out at every depth r = 1..R (each depth
has its own coda KV slot), giving y(p, r) for the depth trace of DESIGN.md section 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from costmodel.trace import CallRecord, DepthRecord

from .cache import KVCache
from .runtime import Runner


class GenerationError(ValueError):
    """A request the model cannot serve (prompt too long, bad depth), in one line."""


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: softmax(logits / T), cut to the top-p nucleus;
        fp32 on the CPU so that draws do not depend on the device."""
        probs = torch.softmax(logits.detach().float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p
            keep[..., 0] = True
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)
            probs = torch.where(mask, probs, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def uniform(self, position: int, stream: int = 0) -> float:
        """A uniform draw that depends only on (seed, position, stream)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + position) * 8 + stream)
        return float(torch.rand((), generator=gen))

    def draw(self, probs: torch.Tensor, position: int, stream: int = 0) -> int:
        """Inverse-CDF draw from probs with the (seed, position, stream) uniform."""
        cdf = probs.cumsum(-1)
        u = self.uniform(position, stream) * float(cdf[-1])
        return int(min(torch.searchsorted(cdf, torch.tensor([u])).item(), probs.numel() - 1))

    def choose(self, logits: torch.Tensor, position: int) -> int:
        """The token committed from ``position``'s logits."""
        if self.greedy:
            return int(logits.argmax())
        return self.draw(self.probs(logits), position)


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int]  # generated token ids (including a final stop token, if any)
    wall_s: float
    schedule: str
    records: list[CallRecord]
    depth_records: list[DepthRecord] = field(default_factory=list)
    stats: dict[str, float | int | None] = field(default_factory=dict)
    cache: KVCache | None = None
    outcomes: dict[int, bool] = field(default_factory=dict)  # position -> draft accepted

    def acceptance_sequence(self) -> list[bool]:
        """Draft outcomes by decoded position (as ``costmodel.simulate`` replays them); a
        position whose draft was never verified (a DtV bonus position) counts as accepted."""
        start = len(self.prompt)
        return [self.outcomes.get(start + i, True) for i in range(len(self.tokens))]

    @property
    def block_calls(self) -> int:
        return sum(1 for r in self.records if r.kind == "block")

    def call_stats(self) -> dict[str, float | int]:
        """Counts from the call trace: block calls, position-steps, positions per call."""
        blocks = [len(r.positions) for r in self.records if r.kind == "block"]
        steps = sum(blocks)
        return {"block_calls": len(blocks), "position_steps": steps,
                "positions_per_block_call": steps / len(blocks) if blocks else 0.0,
                "block_calls_per_token": len(blocks) / len(self.tokens),
                "tokens_per_block_call": len(self.tokens) / len(blocks) if blocks else 0.0}


def make_cache(model: nn.Module, *, prompt_len: int, max_new_tokens: int, depth: int,
               kv_sharing: int, readout_depths: list[int], lookahead: int = 0) -> KVCache:
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
                   readout_depths=readout_depths, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, max_len=total + lookahead + 1, dtype=param.dtype,
                   device=param.device)


def depth_record(position: int, token: int, readouts: dict[int, torch.Tensor]) -> DepthRecord:
    depths = sorted(readouts)
    probs = [torch.softmax(readouts[r].float(), -1) for r in depths]
    return DepthRecord(position=position, token=token,
                       predictions=[int(p.argmax()) for p in probs],
                       top1_prob=[float(p.max()) for p in probs])


def prefill(runner: Runner, prompt: list[int], depth: int, readout_depths: list[int]
            ) -> dict[int, torch.Tensor]:
    """Run the prompt through every depth; return the last position's logits per readout depth.

    A coda with attention reads out every prompt position (its KV is needed later); a coda
    without (Ouro) only the last one."""
    positions = list(range(len(prompt)))
    e, state = runner.prelude(prompt, positions)
    readout_positions = positions if runner.model.config.coda_layers else positions[-1:]
    logits = {}
    for r in range(1, depth + 1):
        state = runner.block(state, e, positions, [r] * len(positions))
        if r in readout_depths:
            sel = state[-len(readout_positions):]
            logits[r] = runner.coda(sel, readout_positions, [r] * len(readout_positions))[-1]
    return logits


def generate_ar(model: nn.Module, prompt: list[int], *, max_new_tokens: int,
                depth: int | None = None, kv_sharing: int = 0,
                sampling: Sampling | None = None, stop_tokens: frozenset[int] = frozenset(),
                depth_trace: bool = False, record: bool = True) -> GenerationResult:
    sampling = sampling or Sampling()
    depth = depth or model.config.depth
    if not prompt:
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"max new tokens must be at least 1, got {max_new_tokens}")
    readouts = list(range(1, depth + 1)) if depth_trace else [depth]
    cache = make_cache(model, prompt_len=len(prompt), max_new_tokens=max_new_tokens,
                       depth=depth, kv_sharing=kv_sharing, readout_depths=readouts)
    runner = Runner(model, cache, record=record)
    start = time.perf_counter()
    last = len(prompt) - 1
    logits = prefill(runner, prompt, depth, readouts)
    token = sampling.choose(logits[depth], last)
    tokens = [token]
    depth_records = [depth_record(last, token, logits)] if depth_trace else []
    while len(tokens) < max_new_tokens and token not in stop_tokens:
        p = last + len(tokens)
        e, state = runner.prelude([token], [p])
        logits = {}
        for r in range(1, depth + 1):
            state = runner.block(state, e, [p], [r])
            if r in readouts:
                logits[r] = runner.coda(state, [p], [r])[0]
        token = sampling.choose(logits[depth], p)
        tokens.append(token)
        if depth_trace:
            depth_records.append(depth_record(p, token, logits))
    wall = time.perf_counter() - start
    return GenerationResult(prompt=list(prompt), tokens=tokens, wall_s=wall, schedule="ar",
                            records=runner.records, depth_records=depth_records, cache=cache,
                            stats={"acceptance": None, "flushed_positions": 0,
                                   "forced_acceptance": False})


def forced_sequence(acceptance: float, count: int, seed: int) -> list[bool]:
    """Seeded Bernoulli outcomes for forced-acceptance timing runs."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(count, generator=gen) < acceptance).tolist()


def generate(model: nn.Module, prompt: list[int], *, schedule: str = "ar", max_new_tokens: int,
             depth: int | None = None, kv_sharing: int = 0, sampling: Sampling | None = None,
             stop_tokens: frozenset[int] = frozenset(), depth_trace: bool = False,
             draft_depth: int | None = None, block_length: int = 4,
             width_cap: int | None = None, force_acceptance: float | None = None,
             seed: int = 0, record: bool = True) -> GenerationResult:
    """Run one schedule: "ar", "dtv" (block_length, draft_depth) or "wfd" (draft_depth,
    width_cap). Without a draft depth, ceil(R / 8) (Huginn at R = 32: 4; Ouro at R = 4: 1)."""
    depth = depth or model.config.depth
    if schedule == "ar":
        return generate_ar(model, prompt, max_new_tokens=max_new_tokens, depth=depth,
                           kv_sharing=kv_sharing, sampling=sampling, stop_tokens=stop_tokens,
                           depth_trace=depth_trace, record=record)
    from .speculative import generate_dtv, generate_wfd

    d = draft_depth if draft_depth is not None else max(1, -(-depth // 8))
    forced = None if force_acceptance is None else forced_sequence(
        force_acceptance, max_new_tokens + 1, seed)
    common = dict(max_new_tokens=max_new_tokens, draft_depth=d, depth=depth,
                  kv_sharing=kv_sharing, sampling=sampling, stop_tokens=stop_tokens,
                  forced_acceptance=forced, record=record)
    if schedule == "dtv":
        return generate_dtv(model, prompt, block_length=block_length, **common)
    if schedule == "wfd":
        return generate_wfd(model, prompt, width_cap=width_cap, **common)
    raise GenerationError(f"unknown schedule {schedule!r}; use ar, dtv or wfd")


@torch.inference_mode()
def full_forward(model: nn.Module, tokens: list[int], depth: int | None = None,
                 readout_depths: list[int] | None = None) -> dict[int, torch.Tensor]:
    """Logits of every position at each readout depth from one pass over the whole sequence,
    without a KV cache (the reference computation incremental decoding must reproduce)."""
    depth = depth or model.config.depth
    readout_depths = readout_depths or [depth]
    positions = list(range(len(tokens)))
    e, state = model.prelude(torch.tensor(tokens, device=next(model.parameters()).device),
                             positions, None)
    out = {}
    for r in range(1, depth + 1):
        state = model.block(state, e, positions, [r] * len(positions), None)
        if r in readout_depths:
            out[r] = model.coda(state, positions, [r] * len(positions), None)
    return out
