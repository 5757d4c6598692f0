"""The specifications the cost model reads: hardware, looped model, workload, schedules.

Every quantity carries its unit in its field name (``_bytes``, ``_s``, ``_per_s``). Parameter
counts and KV bytes are derived from the architecture, never typed in.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .plans import default_draft_depth

Dtype = Literal["fp32", "bf16", "fp16", "fp8"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
PartName = Literal["prelude", "block", "coda"]


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class MatmulCurve(Spec):
    """How long one matrix product takes on this machine, measured against its rows, its size
    and the working set it runs in, instead of a formula for it: a CPU library runs a few rows
    as vector products, splits products over its threads from some row count on, packs blocks,
    and reads weights from whichever cache holds them, each with its own cost.

    ``seconds[k][i][j]``: one product of a ``matrix_bytes[i]`` matrix over ``rows[j]`` rows,
    timed in a chain of such products whose weights total ``working_sets_bytes[k]`` (None where
    the matrix is larger than the working set). The last working set is beyond every cache: the
    weights stream from memory. A call's products run in its part's working set (its weights).
    Those matrices are square; ``aspect_seconds[a][i][j]`` times matrices ``aspects[a]`` times
    as many outputs as inputs, streamed, and a product of another shape takes its aspect's
    time over the square one's (a library runs wide and tall products at different speeds).

    ``streamed_from_bytes``: the smallest working set that copies at memory speed (the copy
    just past the measured cache knee). A working set from there on streams as the last one
    does, where interpolating towards a streamed set several times larger would price it as
    partly cached; None (profiles made before it was measured): the last working set.

    ``row_block``: the rows a product's kernel computes together. A CPU library's kernels work
    on blocks of rows (8 on this project's VM), so 41 rows cost what 48 do; a row count
    the curve did not measure is read at the next multiple of the block. 1 (profiles made
    before it was measured): no blocks, time linear between the measured rows.
    """

    dtype: str
    rows: list[Annotated[int, Field(ge=1)]]
    matrix_bytes: list[Annotated[float, Field(gt=0)]]
    working_sets_bytes: list[Annotated[float, Field(gt=0)]]
    seconds: list[list[list[Annotated[float, Field(gt=0)] | None]]]
    aspects: list[Annotated[float, Field(gt=0)]] = Field(default_factory=list)
    aspect_seconds: list[list[list[Annotated[float, Field(gt=0)]]]] = Field(
        default_factory=list)
    streamed_from_bytes: Annotated[float, Field(gt=0)] | None = None
    row_block: Annotated[int, Field(ge=1)] = 1

    @model_validator(mode="after")
    def _check(self) -> MatmulCurve:
        for axis in (self.rows, self.matrix_bytes, self.working_sets_bytes):
            if sorted(axis) != axis or len(axis) < 2:
                raise ValueError("a matrix-product curve needs two or more increasing rows, "
                                 "sizes and working sets")
        if len(self.seconds) != len(self.working_sets_bytes) or any(
                len(table) != len(self.matrix_bytes) or any(len(line) != len(self.rows)
                                                            for line in table)
                for table in self.seconds):
            raise ValueError("a matrix-product curve's table must be working sets x sizes x rows")
        if any(t is None for line in self.seconds[-1] for t in line):
            raise ValueError("a matrix-product curve's last working set must time every size")
        if len(self.aspect_seconds) != len(self.aspects) or 1.0 in self.aspects or any(
                len(table) != len(self.matrix_bytes) or any(len(line) != len(self.rows)
                                                            for line in table)
                for table in self.aspect_seconds):
            raise ValueError("a matrix-product curve's aspect tables must be aspects (other "
                             "than 1) x sizes x rows")
        return self


class HardwareSpec(Spec):
    """A device plus the software stack that drives it: a roofline (bandwidth, flops, capacity),
    the host's overheads, and optional sub-models a calibration fills (the decoder's kernel
    counts, a CPU's measured matrix-product curve)."""

    name: str
    source: str | None = None  # where the figures come from
    memory_bandwidth_bytes_per_s: Annotated[float, Field(gt=0)]
    peak_flops_per_s: dict[str, Annotated[float, Field(gt=0)]]
    memory_capacity_bytes: Annotated[float, Field(gt=0)]
    bandwidth_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.8
    # Achievable fraction for KV-cache traffic; None means the same as for weights.
    kv_bandwidth_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    flops_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.7
    # Attention's fraction of peak flops (small per-head products). None: flops_efficiency.
    attention_flops_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    # Per call of a part (P, B or C): Python and framework dispatch outside the kernels.
    host_overhead_s: Annotated[float, Field(ge=0)] = 20e-6
    # Per transformer layer in a call, beyond its kernels' launch overhead. 0: every operation
    # costs the same.
    layer_overhead_s: Annotated[float, Field(ge=0)] = 0.0
    # Per layer of an eager call, the host's extra time for the shape of the layer's one
    # attention call (scaled dot product over [key sets, heads, queries per set, keys]): when it
    # reads a single key set (batch 1: one sequence's AR step, a DtV verification, a prefill),
    # and when several queries share each key set (DtV's verification, a prefill). A WFD wave
    # (one query per slot) pays neither. Framework work inside the attention call that the
    # dispatch count does not see; 0 on a CPU, where it is not seen.
    attention_one_set_host_s: Annotated[float, Field(ge=0)] = 0.0
    attention_grouped_host_s: Annotated[float, Field(ge=0)] = 0.0
    # Per key set and query head of each layer's attention, in the attention itself: a CPU's
    # kernel works through (key set, head) pairs one after another, and each costs a fixed time
    # beside its keys' bytes (many short key sets: a batch of WFD waves). 0 on a GPU, whose
    # kernel runs the pairs in parallel.
    attention_key_set_s: Annotated[float, Field(ge=0)] = 0.0
    # Per kernel launched eagerly (the gap a Python-driven framework leaves between kernels).
    launch_overhead_s: Annotated[float, Field(ge=0)] = 5e-6
    # Per kernel replayed from a CUDA graph, when ``cuda_graphs``.
    graph_launch_overhead_s: Annotated[float, Field(ge=0)] = 1e-6
    # Per call replayed from CUDA graphs (the decoder's own work around the replay: copying the
    # call's inputs, the replay itself); None: host_overhead_s. A replayed call has no per-layer
    # host work (layer_overhead_s is eager's).
    graph_host_overhead_s: Annotated[float, Field(ge=0)] | None = None
    cuda_graphs: bool = False
    # Device time per kernel, in both modes: the floor a kernel costs the device beyond its
    # bytes and flops (its launch latency and tail on the device). It adds to the roofline;
    # the host's overheads overlap the sum where ``overhead_overlaps``.
    kernel_device_s: Annotated[float, Field(ge=0)] = 0.0
    # Whether host overheads overlap the device's work (a GPU runs kernels while the host
    # enqueues more: a call costs the larger) or add to it (a CPU runs the kernels itself).
    overhead_overlaps: bool = False
    # Kernels per transformer layer, and for attention per distinct KV slot read when split.
    kernels_per_layer: Annotated[int, Field(ge=0)] = 14
    attention_kernels_per_slot: Annotated[int, Field(ge=0)] = 2
    attention_split_by_slot: bool = True
    # Kernels a call of each part launches outside its layers, by part name (calibration counts
    # the decoder's); missing parts use the model spec's estimate.
    part_extra_kernels: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # The dispatched operations by class (OPERATION_CLASSES), per layer and per part outside its
    # layers, as a GPU calibration counts them (summing to the counts above), and each class's
    # host time relative to an elementwise operation's (measured). With them an eager host pays
    # each operation its class's time (launch_overhead_s x the weight) and a view launches no
    # kernel: no replayed kernel, no device time. Empty: every operation a kernel at one cost.
    layer_operations: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    part_extra_operations: dict[str, dict[str, Annotated[int, Field(ge=0)]]] = Field(
        default_factory=dict)
    operation_host_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict)
    # A CPU's matrix products, measured (None: each streams its weights once at the achievable
    # bandwidth and runs its flops at the achievable peak, as on a GPU).
    matmul: MatmulCurve | None = None
    # The measured curve's times over the decoder's own (fitted: what the products cost in a
    # call, among the other kernels, against the same products timed alone).
    matmul_time_scale: Annotated[float, Field(gt=0)] = 1.0

    OPERATION_CLASSES: ClassVar[tuple[str, ...]] = ("matmul", "attention", "other", "view")

    @model_validator(mode="after")
    def _check_operations(self) -> HardwareSpec:
        counts = [("a layer", self.layer_operations, self.kernels_per_layer)] + [
            (f"the {part} outside its layers", ops, self.part_extra_kernels.get(part))
            for part, ops in self.part_extra_operations.items()]
        for what, ops, total in counts:
            unknown = set(ops) - set(self.OPERATION_CLASSES)
            if unknown:
                raise ValueError(f"unknown operation class {sorted(unknown)[0]!r}; the classes "
                                 f"are {', '.join(self.OPERATION_CLASSES)}")
            if ops and sum(ops.values()) != total:
                raise ValueError(f"the operations of {what} by class sum to "
                                 f"{sum(ops.values())}, not its {total} operations")
        if set(self.operation_host_weights) - set(self.OPERATION_CLASSES):
            raise ValueError("operation_host_weights names an unknown operation class")
        return self

    HOST_TERMS: ClassVar[tuple[str, ...]] = ("host_overhead_s", "layer_overhead_s",
                                             "attention_one_set_host_s",
                                             "attention_grouped_host_s",
                                             "launch_overhead_s", "graph_launch_overhead_s",
                                             "graph_host_overhead_s")

    def with_host_speed(self, speed: float) -> HardwareSpec:
        """This hardware with a host ``speed`` times faster: every host term (dispatch per call,
        per layer, per kernel launched or replayed) divided by it, the device's untouched."""
        if not speed > 0:
            raise ValueError(f"host speed must be a positive factor, got {speed}")
        return self.model_copy(update={term: getattr(self, term) / speed
                                       for term in self.HOST_TERMS
                                       if getattr(self, term) is not None})

    def with_device_speed(self, speed: float) -> HardwareSpec:
        """This hardware with a device ``speed`` times faster: its bandwidth and flops times it,
        its measured products, per-key-set and per-kernel device times divided by it, the
        host's untouched."""
        if not speed > 0:
            raise ValueError(f"device speed must be a positive factor, got {speed}")
        return self.model_copy(update={
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s * speed,
            "peak_flops_per_s": {k: v * speed for k, v in self.peak_flops_per_s.items()},
            "matmul_time_scale": self.matmul_time_scale / speed,
            "attention_key_set_s": self.attention_key_set_s / speed,
            "kernel_device_s": self.kernel_device_s / speed})

    @property
    def mode(self) -> str:
        return "graphs" if self.cuda_graphs else "eager"

    def in_mode(self, mode: str | None) -> HardwareSpec:
        """This hardware running in ``mode`` ("eager" or "graphs"; None: as it is)."""
        if mode is None or mode == self.mode:
            return self
        if mode not in ("eager", "graphs"):
            raise ValueError(f"unknown mode {mode!r}; use eager or graphs")
        return self.model_copy(update={"cuda_graphs": mode == "graphs"})

    @property
    def kernel_overhead_s(self) -> float:
        return self.graph_launch_overhead_s if self.cuda_graphs else self.launch_overhead_s

    @property
    def call_overhead_s(self) -> float:
        """The host's time per call of a part in this mode, outside its layers and kernels."""
        if self.cuda_graphs and self.graph_host_overhead_s is not None:
            return self.graph_host_overhead_s
        return self.host_overhead_s

    @property
    def layer_host_s(self) -> float:
        """The host's time per layer of a call: eager's dispatch; none in a replayed graph."""
        return 0.0 if self.cuda_graphs else self.layer_overhead_s

    def achievable_flops_per_s(self, dtype: str) -> float:
        if dtype not in self.peak_flops_per_s:
            known = ", ".join(sorted(self.peak_flops_per_s))
            raise ValueError(f"hardware {self.name} has no peak flops for {dtype} (has {known})")
        return self.peak_flops_per_s[dtype] * self.flops_efficiency

    @property
    def weight_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.bandwidth_efficiency

    @property
    def kv_bandwidth_bytes_per_s(self) -> float:
        eff = self.kv_bandwidth_efficiency or self.bandwidth_efficiency
        return self.memory_bandwidth_bytes_per_s * eff


class PartSpec(Spec):
    """One of P, B, C: its transformer layers plus the extra matrices it multiplies once a call."""

    name: PartName
    layers: int
    layer_params: int
    # Matrices outside the layers that every call streams and multiplies: Huginn's adapter, the
    # LM head, Ouro's exit gate.
    extra_matrix_params: int
    # Norm weights outside the layers (final norms).
    extra_norm_params: int
    # Embedding tables: a call gathers one row per position, it does not stream the table.
    lookup_params: int
    extra_kernels: int
    # The (out, in) shape of each matrix product a call runs, per layer (Huginn fuses q, k, v
    # into one matrix and gate and up into another: 4; Ouro keeps them apart: 7) and outside the
    # layers (the adapter, the head, the exit gate).
    layer_matrices: tuple[tuple[int, int], ...] = ()
    extra_matrices: tuple[tuple[int, int], ...] = ()

    @property
    def products_per_layer(self) -> int:
        return len(self.layer_matrices)

    @property
    def matrix_products(self) -> int:
        return self.layers * len(self.layer_matrices) + len(self.extra_matrices)

    @property
    def weight_params(self) -> int:
        """Parameters streamed from memory once per call, whatever the number of positions."""
        return self.layers * self.layer_params + self.extra_matrix_params + self.extra_norm_params

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_params + self.extra_matrix_params


class LoopedModelSpec(Spec):
    """A looped LM: prelude P, recurrent block B applied R times, coda C.

    Huginn: P = embedding + prelude layers, B = adapter + core layers, C = coda layers, the final
    norm (applied twice) and the head. Ouro: P = embedding, B = every layer plus the final norm,
    C = the head (and the exit gate).
    """

    name: str
    source: str | None = None  # where the architecture comes from
    family: Literal["huginn", "ouro"]
    hidden_size: Annotated[int, Field(gt=0)]
    num_heads: Annotated[int, Field(gt=0)]
    num_kv_heads: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)]
    mlp_size: Annotated[int, Field(gt=0)]
    vocab_size: Annotated[int, Field(gt=0)]
    tied_head: bool
    prelude_layers: Annotated[int, Field(ge=0)]
    core_layers: Annotated[int, Field(gt=0)]
    coda_layers: Annotated[int, Field(ge=0)]
    qk_bias: bool = False
    exit_gate: bool = False
    default_depth: Annotated[int, Field(ge=2)]
    default_acceptance: Annotated[float, Field(ge=0, le=1)]
    default_draft_depth: Annotated[int, Field(ge=1)]  # given, or ceil(R / 8) below R
    max_position_embeddings: Annotated[int, Field(gt=0)]

    @model_validator(mode="before")
    @classmethod
    def _default_draft_depth(cls, data):
        if (isinstance(data, dict) and data.get("default_draft_depth") is None
                and "default_depth" in data):
            data = {**data, "default_draft_depth": default_draft_depth(data["default_depth"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> LoopedModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.default_draft_depth >= self.default_depth:
            raise ValueError("default_draft_depth must be below default_depth")
        return self

    # -- architecture arithmetic -------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q = self.num_heads * hd
        kv = self.num_kv_heads * hd
        attention = h * (q + 2 * kv) + q * h
        mlp = 3 * h * self.mlp_size  # gated: gate and up (h -> I each), down (I -> h)
        norms = 4 * h  # sandwich: four RMSNorms per layer in both families
        bias = 2 * q if self.qk_bias else 0
        return attention + mlp + norms + bias

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def layer_matrices(self) -> tuple[tuple[int, int], ...]:
        """The (out, in) shape of each matrix product of a layer, in the family's layout."""
        h, i = self.hidden_size, self.mlp_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.family == "huginn":  # fused qkv, fused gate and up
            return ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i))
        return ((q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i))

    def part(self, name: PartName) -> PartSpec:
        h = self.hidden_size
        head = self.embedding_params  # streamed by every coda call, tied or not
        per_layer = self.layer_matrices()
        if self.family == "huginn":
            if name == "prelude":
                return PartSpec(name=name, layers=self.prelude_layers,
                                layer_params=self.layer_params, extra_matrix_params=0,
                                extra_norm_params=0, lookup_params=self.embedding_params,
                                extra_kernels=2, layer_matrices=per_layer)
            if name == "block":
                # adapter: Linear(2h -> h) on concat(state, embedding); state init + concat
                return PartSpec(name=name, layers=self.core_layers,
                                layer_params=self.layer_params, extra_matrix_params=2 * h * h,
                                extra_norm_params=0, lookup_params=0, extra_kernels=3,
                                layer_matrices=per_layer, extra_matrices=((h, 2 * h),))
            # ln_f before and after the coda layers (one weight), then the (tied) head
            return PartSpec(name=name, layers=self.coda_layers, layer_params=self.layer_params,
                            extra_matrix_params=head, extra_norm_params=h,
                            lookup_params=0, extra_kernels=3, layer_matrices=per_layer,
                            extra_matrices=((self.vocab_size, h),))
        if name == "prelude":
            return PartSpec(name=name, layers=0, layer_params=self.layer_params,
                            extra_matrix_params=0, extra_norm_params=0,
                            lookup_params=self.embedding_params, extra_kernels=1,
                            layer_matrices=per_layer)
        if name == "block":
            return PartSpec(name=name, layers=self.core_layers, layer_params=self.layer_params,
                            extra_matrix_params=0, extra_norm_params=h, lookup_params=0,
                            extra_kernels=1, layer_matrices=per_layer)
        gate = (h + 1) if self.exit_gate else 0
        return PartSpec(name=name, layers=self.coda_layers, layer_params=self.layer_params,
                        extra_matrix_params=head + gate, extra_norm_params=0, lookup_params=0,
                        extra_kernels=2 if self.exit_gate else 1, layer_matrices=per_layer,
                        extra_matrices=((self.vocab_size, h), (1, h)) if self.exit_gate
                        else ((self.vocab_size, h),))

    @property
    def parts(self) -> dict[str, PartSpec]:
        return {n: self.part(n) for n in ("prelude", "block", "coda")}

    @property
    def num_params(self) -> int:
        """Unique trainable parameters (a tied head counted once)."""
        streamed = sum(part.weight_params for part in self.parts.values())
        return streamed + (0 if self.tied_head else self.embedding_params)

    def kv_bytes_per_token_per_layer(self, dtype: str) -> int:
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def core_slots(self, depth: int, kv_sharing: int) -> int:
        """KV slots per core layer: one per depth, or the ``kv_sharing`` shared ones."""
        return depth if kv_sharing == 0 else min(kv_sharing, depth)

    def kv_bytes_per_token(self, dtype: str, depth: int | None = None, kv_sharing: int = 0,
                           readout_depths: int = 1) -> int:
        """KV bytes one token occupies: prelude slots, core slots (per depth or shared), and one
        coda slot per readout depth (AR reads out at R only; DtV and WFD at d and R)."""
        depth = depth or self.default_depth
        layer_slots = (self.prelude_layers + self.core_layers * self.core_slots(depth, kv_sharing)
                       + self.coda_layers * readout_depths)
        return layer_slots * self.kv_bytes_per_token_per_layer(dtype)

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights held in memory (a tied head stored once)."""
        return self.num_params * DTYPE_BYTES[dtype]

    def width_to_draft_depth(self, width: int, depth: int | None = None) -> int:
        depth = depth or self.default_depth
        return math.ceil(depth / width)


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
    # 0: recurrence-specific KV (one slot per depth); s >= 1: s shared slots, depth r -> r mod s.
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
        if self.adaptive and self.prompts is not None:
            raise ValueError("a run of prompts is priced at fixed depth only; leave out "
                             "--prompts to price exits")
        if self.prompts is not None and self.prompts < self.batch_size:
            raise ValueError(f"{self.prompts} prompts cannot fill a batch of "
                             f"{self.batch_size}: give at least as many prompts as the batch")
        if self.prompts is not None and self.new_tokens < 2:
            raise ValueError("a run of prompts decodes at least 2 new tokens each (the "
                             "prefill commits the first)")
        return self


class AR(Spec):
    kind: Literal["ar"] = "ar"


class DtV(Spec):
    kind: Literal["dtv"] = "dtv"
    block_length: Annotated[int, Field(ge=1)]
    draft_depth: Annotated[int, Field(ge=1)]


class WFD(Spec):
    kind: Literal["wfd"] = "wfd"
    draft_depth: Annotated[int, Field(ge=1)]
    width_cap: Annotated[int, Field(ge=1)] | None = None


Schedule = Annotated[AR | DtV | WFD, Field(discriminator="kind")]
