"""Exit rules on vLLM: the engine's (``hf_overrides={"exit_rule": "kl:0.001"}``; "none": only
those requests ask for) and a request's own (``SamplingParams(extra_args={"exit": "kl:0.01",
"exit_min_depth": 3})``, or ``"exit": "none"`` for fixed depth), resolved into the rule the
request's wave runs (``wfd.serving.wave``), and what the waves do with them (``WaveExits``): the
checks of every wave at a point of the same kind made at once, and the KV of the depths an
exited position skips.

A request's rule is checked where vLLM admits it, before it reaches the engine: ``ExitParams``
is a logits processor installed as a vLLM plugin (entry point group ``vllm.logits_processors``),
whose ``validate_params`` vLLM's input processor calls for every request; a rule the engine
cannot run is vLLM's 400 error in one line, and the server stays up. Its ``apply`` changes no
logits. The engine's settings it checks against are recorded where vLLM makes the engine's
config (``ScheduleHook``), in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from costmodel.exits import ExitRule, ForcedExits
from costmodel.slots import core_slot
from wfd.exits import check_rows

from .ahead import plain_greedy
from .configs import check_exit_rule, served_rule
from .wave_kv import allocated


@dataclass(frozen=True)
class EngineExits:
    """What a request's rule is checked against: whether the engine serves exit rules, its own
    (None: fixed depth unless a request sets one), the shallowest depth it reads out at for
    them, the model type and its depth R."""

    serves: bool
    rule: ExitRule | None
    min_depth: int
    model_type: str
    depth: int
    drafts: bool = False  # the plugin's WFD or DtV: greedy requests only, with a rule

    @classmethod
    def of(cls, cfg) -> EngineExits:
        """A looped config's (``configs.LoopedConfig``)."""
        return cls(cfg.serves_exits, cfg.exits, int(cfg.exit_min_depth), cfg.model_type,
                   cfg.depth, cfg.schedule in ("dtv", "wfd"))


def request_rule(engine: EngineExits, asked: dict | None) -> ExitRule | None:
    """The rule a request runs: the engine's, or its own (``asked``: its extra_args), or none;
    a ValueError in one line for one the engine cannot run."""
    asked = asked or {}
    text, min_depth = asked.get("exit"), asked.get("exit_min_depth")
    if text is None and min_depth is None:
        return engine.rule
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    if not engine.serves:
        raise ValueError("this engine decodes at a fixed depth: start it with the exit_rule "
                         "option to serve requests with an exit rule")
    if text is None and engine.rule is None:
        raise ValueError("exit_min_depth goes with an exit rule: this engine has none of its "
                         "own, so give the request's (extra_args exit)")
    base = engine.rule if text is None else served_rule(str(text), 1, engine.depth)
    if isinstance(base, ForcedExits):
        if min_depth is not None:
            raise ValueError("forced exit depths are their own: leave out exit_min_depth "
                             "with them")
        return base
    lowest = engine.min_depth
    try:
        depth = lowest if min_depth is None else int(min_depth)
    except (TypeError, ValueError):
        raise ValueError(f"exit_min_depth must be a whole number, got {min_depth!r}") from None
    if not lowest <= depth <= engine.depth:
        raise ValueError(f"exit_min_depth must be in {lowest}..{engine.depth} on this engine "
                         f"(its exit_min_depth is {lowest}), got {depth}")
    return check_exit_rule(ExitRule(base.name, base.threshold, depth), engine.model_type,
                           engine.depth)


class ExitParams(LogitsProcessor):
    """Checks each request's exit rule where vLLM admits it (``validate_params``); changes no
    logits."""

    engine: EngineExits | None = None  # the looped engine made in this process, if any

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """A request's rule, if any, one the engine can run; with the plugin's WFD or DtV, on a
        plain greedy request only: a token that exits by the draft depth is committed from its
        own argmax there, which is vLLM's token only for such a request."""
        engine = cls.engine
        if engine is None:  # another model's engine: its extra_args are not ours
            return
        rule = request_rule(engine, sampling_params.extra_args)
        if rule is not None and engine.drafts and not plain_greedy(sampling_params):
            raise ValueError("exit rules with schedule wfd or dtv serve plain greedy requests "
                             "(temperature 0, no penalty, bias or token restriction); sample "
                             "with exits on schedule ar, or send extra_args exit \"none\"")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass


class WaveExits:
    """The exit checks and KV copies of a ``WaveDecoder``'s waves (each wave's rule and its
    memory: ``wave.exits``, a ``wfd.exits.ExitTracker``)."""

    def __init__(self, decoder):
        self.decoder, self.model = decoder, decoder.model
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # depth -> its layers

    def check(self, pending: list) -> None:
        """The checks waves are paused at (``(wave, Check)`` pairs): the logits of every
        checked readout (rules that read them) and the gate's hazards at every checked state
        computed in one call each, and the waves with the same rule measured together; each
        wave's verdict is what its plan is sent next."""
        model = self.model
        rows = [(wave, p) for wave, event in pending for p in event.positions]
        rules = [wave.exits.rule for wave, _ in rows]
        reads = [rule.reads_readouts for rule in rules]
        read_rows = [row for row, read in zip(rows, reads, strict=True) if read]
        logits = []
        if read_rows:
            batch = model.compute_logits(torch.stack([w.readouts[p] for w, p in read_rows]))
            for (w, p), token in zip(read_rows, batch.argmax(-1).tolist(), strict=True):
                w.argmaxes[p] = token  # what a draft or a commit reads (``WaveDecoder.argmax``)
            logits = list(batch)
        gates = [rule.name == "gate" for rule in rules]
        hazards = model.exit_lambda(torch.stack([
            w.states[p] for (w, p), gate in zip(rows, gates, strict=True) if gate])).tolist() \
            if any(gates) else []
        logits, hazards = iter(logits), iter(hazards)
        readouts = [next(logits) if read else None for read in reads]
        own = [next(hazards) if gate else None for gate in gates]
        states = torch.stack([w.states[p] for w, p in rows])
        depths = [r for _, event in pending for r in event.depths]
        for wave, _ in pending:
            wave.reply = set()
        groups: dict[object, list[int]] = {}  # rule -> its rows (rules are frozen: hashable)
        for i, rule in enumerate(rules):
            groups.setdefault(rule, []).append(i)
        exits = []
        for rule, group in groups.items():
            fired = check_rows([(rows[i][0].exits, rows[i][1]) for i in group],
                               [depths[i] for i in group], states[group],
                               [readouts[i] for i in group],
                               [own[i] for i in group] if rule.name == "gate" else None)
            for i in (i for i, f in zip(group, fired, strict=True) if f):
                wave, p = rows[i]
                wave.reply.add(p)
                exits.append((wave, p, depths[i]))
        self.exit_kv(exits)

    def layers(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, target) caches of a position that exits at ``depth``: its core caches at
        that step into those of the deeper steps it never wrote, its coda caches at that
        readout depth into those of deeper readout depths (wfd's rule,
        ``wfd.cache.KVCache.exit``); worked out once per depth."""
        if depth not in self.copies:
            model, coda_slot = self.model, self.decoder.coda_slot
            written = {core_slot(r, model.kv_sharing) for r in range(1, depth + 1)}
            deeper = {core_slot(r, model.kv_sharing): r
                      for r in range(depth + 1, model.depth + 1)}
            pairs = [(model.core_layer_index(depth, j), model.core_layer_index(r, j))
                     for slot, r in deeper.items() if slot not in written
                     for j in range(model.core_layers)]
            if depth in coda_slot:
                pairs += [(model.coda_layer_index(coda_slot[depth], j),
                           model.coda_layer_index(coda_slot[r], j))
                          for r in coda_slot if r > depth for j in range(model.arch.coda_layers)]
            sources, targets = zip(*pairs, strict=True) if pairs else ((), ())
            self.copies[depth] = torch.tensor(sources, dtype=torch.long), torch.tensor(
                targets, dtype=torch.long)
        return self.copies[depth]

    def exit_kv(self, exits: list) -> None:
        """Each exited position's KV (``(wave, position, depth)``) at its exit depth copied
        into the caches of the depths it skips (``layers``): in the paged cache where its block
        is allocated, all in one copy; in its wave's side buffer where not."""
        paged = self.decoder.paged_kv() if exits else None
        copies = []
        for wave, position, depth in exits:
            sources, targets = self.layers(depth)
            if not len(sources):
                continue
            block = allocated(wave, position, paged.block)
            if block:
                copies.append((sources, targets, block, position % paged.block))
                continue
            for source, target in zip(sources.tolist(), targets.tolist(), strict=True):
                wave.ahead[(target, position)] = wave.ahead[(source, position)]
        if copies:
            paged.copy(torch.cat([c[0] for c in copies]), torch.cat([c[1] for c in copies]),
                       torch.tensor([c[2] for c in copies for _ in range(len(c[0]))]),
                       torch.tensor([c[3] for c in copies for _ in range(len(c[0]))]))
