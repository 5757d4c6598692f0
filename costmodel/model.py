"""A looped LM as the cost model reads it: its parts (prelude, recurrent block, coda), their
parameters and matrices, its depth, draft depth and KV bytes, all derived from the
architecture."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from .plans import default_draft_depth
from .specs import DTYPE_BYTES, PartName, Spec, decoder_operations


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
    # The operations this decoder dispatches by class (HardwareSpec.OPERATION_CLASSES) per layer
    # and per call outside the layers, as counted for the family (costmodel/data/operations.json).
    layer_operations: dict[str, int]
    extra_operations: dict[str, int]
    # The (out, in) shape of each matrix product a call runs, per layer (Huginn fuses q, k, v
    # into one matrix and gate and up into another: 4; Ouro keeps them apart: 7) and outside the
    # layers (the adapter, the head, the exit gate).
    layer_matrices: tuple[tuple[int, int], ...] = ()
    extra_matrices: tuple[tuple[int, int], ...] = ()

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
    # the devices this spec's layers are split over (costmodel.parallel.shard): above 1, its
    # heads, KV heads, MLP rows and vocabulary are one device's share
    tensor_parallel: Annotated[int, Field(ge=1)] = 1

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
        counted = decoder_operations(self.family)
        return PartSpec(**self._part_shape(name), layer_operations=counted["layer"],
                        extra_operations=counted[name])

    def _part_shape(self, name: PartName) -> dict:
        """A part's layers, parameters and matrix shapes (PartSpec's fields but its operations)."""
        h = self.hidden_size
        head = self.embedding_params  # streamed by every coda call, tied or not
        shape = dict(name=name, layer_params=self.layer_params, extra_norm_params=0,
                     lookup_params=0, extra_matrix_params=0,
                     layer_matrices=self.layer_matrices())
        if self.family == "huginn":
            if name == "prelude":
                return {**shape, "layers": self.prelude_layers,
                        "lookup_params": self.embedding_params}
            if name == "block":
                # adapter: Linear(2h -> h) on concat(state, embedding)
                return {**shape, "layers": self.core_layers, "extra_matrix_params": 2 * h * h,
                        "extra_matrices": ((h, 2 * h),)}
            # ln_f before and after the coda layers (one weight), then the (tied) head
            return {**shape, "layers": self.coda_layers, "extra_matrix_params": head,
                    "extra_norm_params": h, "extra_matrices": ((self.vocab_size, h),)}
        if name == "prelude":
            return {**shape, "layers": 0, "lookup_params": self.embedding_params}
        if name == "block":
            return {**shape, "layers": self.core_layers, "extra_norm_params": h}
        gate = (h + 1) if self.exit_gate else 0
        return {**shape, "layers": self.coda_layers, "extra_matrix_params": head + gate,
                "extra_matrices": ((self.vocab_size, h), (1, h)) if self.exit_gate
                else ((self.vocab_size, h),)}

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
        return (self.kv_layer_slots(depth, kv_sharing, readout_depths)
                * self.kv_bytes_per_token_per_layer(dtype))

    def kv_layer_slots(self, depth: int, kv_sharing: int = 0, readout_depths: int = 1) -> int:
        """The attention layers' KV slots a token fills: per prelude layer, per (core slot, core
        layer), per (readout depth, coda layer)."""
        return (self.prelude_layers + self.core_layers * self.core_slots(depth, kv_sharing)
                + self.coda_layers * readout_depths)

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights held in memory (a tied head stored once)."""
        return self.num_params * DTYPE_BYTES[dtype]

    def width_to_draft_depth(self, width: int, depth: int | None = None) -> int:
        depth = depth or self.default_depth
        return math.ceil(depth / width)
