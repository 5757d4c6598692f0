"""A workload: the context, new tokens, acceptance (or a depth trace), batch, dtype, KV
sharing, depth, a run of prompts and adaptive depth a prediction prices."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .specs import Dtype, Spec


class Workload(Spec):
    context_length: Annotated[int, Field(ge=1)] = 1024
    new_tokens: Annotated[int, Field(ge=1)] = 512
    # None: the model's default acceptance, or the one a depth trace gives.
    acceptance: Annotated[float, Field(ge=0, le=1)] | None = None
    # A measured depth trace (JSON Lines): the acceptance of the draft depth
    # is read from it (the rate at which y(p, d) equals y(p, R) over its decoded positions).
    depth_trace: str | None = None
    batch_size: Annotated[int, Field(ge=1)] = 1
    dtype: Dtype = "bf16"
    # 0: one KV slot per depth; s in 1..R: s shared slots, depth r in slot (r - 1) mod s
    kv_sharing: Annotated[int, Field(ge=0)] = 0
    # None: the model's default depth R.
    depth: Annotated[int, Field(ge=2)] | None = None
    # None: the steady state of a batch kept full. N: a run of N prompts, batch_size at a time
    # (a finished sequence's place goes to the next prompt), to its end: the batch empties as
    # its last sequences finish (costmodel.predict, simulated call by call).
    prompts: Annotated[int, Field(ge=1)] | None = None
    # Adaptive depth (costmodel.adaptive): each position stops at its own depth. The exit depths
    # come from a distribution {depth: probability} (with ``acceptance`` for the drafts of
    # positions that go past the draft depth), or from ``depth_trace`` read under ``exit_rule``
    # ("RULE[:THRESHOLD]", costmodel.exits), which alone also says how a rule reads out.
    exit_depths: dict[int, float] | None = None
    exit_rule: str | None = None
    exit_min_depth: Annotated[int, Field(ge=1)] = 1
    # what later tokens read of an exited token's skipped depths (costmodel.exits.EXIT_KV):
    # under "reference" a wave defers readouts until older tokens are final (costmodel.plans)
    exit_kv: Literal["latest", "reference"] = "latest"

    @property
    def adaptive(self) -> bool:
        return self.exit_depths is not None or self.exit_rule is not None

    @model_validator(mode="after")
    def _one_acceptance(self) -> Workload:
        if self.acceptance is not None and self.depth_trace is not None:
            raise ValueError("give an acceptance or a depth trace, not both")
        if self.exit_depths is not None and self.depth_trace is not None:
            raise ValueError("exit depths come from a distribution or a depth trace, not both")
        if self.exit_rule is not None and self.exit_depths is None and self.depth_trace is None:
            raise ValueError("an exit rule is priced from a depth trace (or give the exit "
                             "depths' distribution)")
        if self.exit_kv != "latest" and not self.adaptive:
            raise ValueError("the exit KV rule (--exit-kv) goes with exits (--exit or "
                             "--exit-depths)")
        if self.adaptive and self.prompts is not None:
            raise ValueError("a run of prompts is priced at fixed depth only; leave out "
                             "--prompts to price exits")
        if self.prompts is not None and self.prompts < self.batch_size:
            raise ValueError(f"{self.prompts} prompt{'s' * (self.prompts > 1)} cannot fill a "
                             f"batch of {self.batch_size}: give at least as many prompts as "
                             "the batch")
        if self.prompts is not None and self.new_tokens < 2:
            raise ValueError("a run of prompts decodes at least 2 new tokens each (the "
                             "prefill commits the first)")
        return self
