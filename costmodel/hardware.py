"""The hardware a prediction prices: its roofline, host, CUDA graphs, operation counts and a
CPU's measured product curve (a preset or a calibration profile's fitted spec)."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from .links import TensorParallel
from .specs import Spec

# The eager host's time per dispatched operation when no calibration gives one: the mean of the
# two H200 eager calibrations (costmodel/data/profiles/gpu-{huginn,ouro}-bf16.json: 8.34 and
# 9.51 us).
EAGER_HOST_S_PER_OPERATION = 8.93e-6
EAGER_HOST_SOURCE = ("8.93 us per dispatched operation (the mean of the H200 eager calibrations, "
                     "costmodel/data/profiles/gpu-*-bf16.json) x this decoder's operations per "
                     "call "
                     "(costmodel/data/operations.json)")


class MatmulCurve(Spec):
    """How long one matrix product takes on this machine, measured against its rows, its size and
    the working set it runs in, instead of a formula for it (docs/costmodel.md, "One call").

    ``seconds[k][i][j]``: one product of a ``matrix_bytes[i]`` square matrix over ``rows[j]``
    rows, in a chain of products whose weights total ``working_sets_bytes[k]`` (None where the
    matrix is larger; the last set streams from memory). ``aspect_seconds[a][i][j]``: streamed
    matrices with ``aspects[a]`` times as many outputs as inputs. ``streamed_from_bytes``: the
    smallest working set that copies at memory speed. ``row_block``: the rows a product's kernel
    computes together (a row count between blocks costs the next multiple). The last two are None
    and 1 in profiles made before they were measured."""

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


class Roofline(Spec):
    """The device: what its datasheet gives (bandwidth, peak flops, capacity), the fractions of
    them a decoder achieves, and the floor each kernel costs it beyond its bytes and flops."""

    memory_bandwidth_bytes_per_s: Annotated[float, Field(gt=0)]
    peak_flops_per_s: dict[str, Annotated[float, Field(gt=0)]]
    memory_capacity_bytes: Annotated[float, Field(gt=0)]
    bandwidth_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.8
    # Achievable fraction for KV-cache traffic; None means the same as for weights.
    kv_bandwidth_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    flops_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.7
    # Attention's fraction of peak flops (small per-head products). None: flops_efficiency.
    attention_flops_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    # Device time per kernel, in both modes (its launch latency and tail on the device). It adds
    # to the roofline; the host's overheads overlap the sum where ``Host.overhead_overlaps``.
    kernel_device_s: Annotated[float, Field(ge=0)] = 0.0


class Host(Spec):
    """The host driving the device eagerly: its time per call of a part, per layer and per
    dispatched operation, and whether that time overlaps the device's."""

    # Per call of a part (P, B or C): Python and framework dispatch outside the kernels.
    host_overhead_s: Annotated[float, Field(ge=0)] = 20e-6
    # Per transformer layer in a call, beyond its kernels' launch overhead. 0: every operation
    # costs the same.
    layer_overhead_s: Annotated[float, Field(ge=0)] = 0.0
    # Per operation dispatched (the gap a Python-driven framework leaves between kernels).
    # Default: what the GPU eager calibrations measured (EAGER_HOST_S_PER_OPERATION).
    launch_overhead_s: Annotated[float, Field(ge=0)] = EAGER_HOST_S_PER_OPERATION
    # Per layer, the extra time for the shape of the layer's one attention call (scaled dot
    # product over [key sets, heads, queries per set, keys]): when it reads a single key set
    # (batch 1: an AR step, a DtV verification, a prefill), and when several queries share each
    # key set (DtV's verification, a prefill). A WFD wave (one query per slot) pays neither.
    # Framework work inside the attention call that the dispatch count does not see.
    attention_one_set_host_s: Annotated[float, Field(ge=0)] = 0.0
    attention_grouped_host_s: Annotated[float, Field(ge=0)] = 0.0
    # Whether the host's time overlaps the device's work (a GPU runs kernels while the host
    # enqueues more: a call costs the larger) or adds to it (a CPU runs the kernels itself).
    overhead_overlaps: bool = False


class Graphs(Spec):
    """CUDA graphs: whether the decoder replays its calls from them, and what a replay costs the
    host (no per-layer work: the per-layer terms are eager's)."""

    cuda_graphs: bool = False
    # Per kernel replayed.
    graph_launch_overhead_s: Annotated[float, Field(ge=0)] = 1e-6
    # Per call replayed (the decoder's own work around the replay: copying the call's inputs,
    # the replay itself); None: Host.host_overhead_s.
    graph_host_overhead_s: Annotated[float, Field(ge=0)] | None = None


OPERATION_CLASSES = ("matmul", "attention", "other", "view")


class Operations(Spec):
    """What a call dispatches, as a calibration counts it. Without counts (a preset) the cost
    model counts this decoder's own operations for the model's family
    (costmodel/data/operations.json), one attention per layer whatever the slots."""

    # Kernels per transformer layer, and for attention per distinct KV slot read when split.
    kernels_per_layer: Annotated[int, Field(ge=0)] | None = None
    attention_kernels_per_slot: Annotated[int, Field(ge=0)] = 2
    attention_split_by_slot: bool = True
    # Kernels a call of each part launches outside its layers, by part name; missing parts use
    # the model spec's count.
    part_extra_kernels: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # The operations by class (OPERATION_CLASSES), per layer and per part outside its layers
    # (summing to the counts above), and each class's host time relative to an elementwise
    # operation's (measured). With them an eager host pays each operation its class's time
    # (launch_overhead_s x the weight) and a view launches no kernel: no replayed kernel, no
    # device time. Empty: every operation a kernel at one cost.
    layer_operations: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    part_extra_operations: dict[str, dict[str, Annotated[int, Field(ge=0)]]] = Field(
        default_factory=dict)
    operation_host_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> Operations:
        if self.kernels_per_layer is None and (self.layer_operations
                                               or self.part_extra_operations):
            raise ValueError("operations by class need the kernels_per_layer they sum to")
        counts = [("a layer", self.layer_operations, self.kernels_per_layer)] + [
            (f"the {part} outside its layers", ops, self.part_extra_kernels.get(part))
            for part, ops in self.part_extra_operations.items()]
        for what, ops, total in counts:
            unknown = set(ops) - set(OPERATION_CLASSES)
            if unknown:
                raise ValueError(f"unknown operation class {sorted(unknown)[0]!r}; the classes "
                                 f"are {', '.join(OPERATION_CLASSES)}")
            if ops and sum(ops.values()) != total:
                raise ValueError(f"the operations of {what} by class sum to "
                                 f"{sum(ops.values())}, not its {total} operations")
        if set(self.operation_host_weights) - set(OPERATION_CLASSES):
            raise ValueError("operation_host_weights names an unknown operation class")
        return self


class CpuTerms(Spec):
    """A CPU's matrix products as measured instead of a roofline's, and its attention's cost per
    key set: what a processor that runs its kernels one after another adds."""

    matmul: MatmulCurve
    # The measured curve's times over the decoder's own (fitted: what the products cost in a
    # call, among the other kernels, against the same products timed alone).
    matmul_time_scale: Annotated[float, Field(gt=0)] = 1.0
    # Per key set and query head of each layer's attention: a CPU's kernel works through
    # (key set, head) pairs one after another, each at a fixed time beside its keys' bytes
    # (many short key sets: a batch of WFD waves).
    attention_key_set_s: Annotated[float, Field(ge=0)] = 0.0


class HardwareSpec(Spec):
    """A device plus the software stack that drives it, in parts: the roofline (a datasheet's
    figures), the eager host, CUDA graphs' replay, the operations a call dispatches, and for a
    CPU its measured products (None: products at the roofline, as on a GPU)."""

    name: str
    source: str | None = None  # where the figures come from
    roofline: Roofline
    host: Host = Host()
    graphs: Graphs = Graphs()
    operations: Operations = Operations()
    cpu: CpuTerms | None = None
    # T devices of this kind running each call together, and their link (costmodel.parallel)
    tensor_parallel: TensorParallel | None = None

    PARTS: ClassVar[dict[str, type[Spec]]] = {
        "roofline": Roofline, "host": Host, "graphs": Graphs, "operations": Operations,
        "cpu": CpuTerms}
    # each field's part: the fields' names are unique across the parts, so a coefficient is
    # named by its field alone
    PART_OF: ClassVar[dict[str, str]] = {
        field: part for part, cls in PARTS.items() for field in cls.model_fields}
    OPERATION_CLASSES: ClassVar[tuple[str, ...]] = OPERATION_CLASSES

    @model_validator(mode="before")
    @classmethod
    def _from_fields(cls, data: object) -> object:
        """A spec given field by field (as profiles of schema 4 and earlier hold it, and as
        ``flat()`` gives it) is grouped into its parts."""
        if not isinstance(data, dict) or not set(data) & set(cls.PART_OF):
            return data
        if set(data) & set(cls.PARTS):
            raise ValueError("give the hardware in its parts or field by field, not both")
        grouped: dict[str, dict] = {}
        out = {}
        for name, value in data.items():
            if name in cls.PART_OF:
                grouped.setdefault(cls.PART_OF[name], {})[name] = value
            else:
                out[name] = value
        cpu = grouped.pop("cpu", {})
        if cpu.get("matmul") is not None:
            out["cpu"] = cpu
        elif any(cpu.get(name, 0.0) != 0.0 for name in ("attention_key_set_s",)):
            raise ValueError("attention_key_set_s is a CPU term: it needs the measured matmul")
        return {**out, **grouped}

    def flat(self) -> dict:
        """Every field by name, the parts' together (JSON types): the inverse of the grouping."""
        dumped = self.model_dump(mode="json")
        out = {k: v for k, v in dumped.items() if k not in self.PARTS}
        for part, cls in self.PARTS.items():  # a missing part: its fields' defaults (None)
            out.update(dumped[part] or {name: None if field.is_required() else field.default
                                        for name, field in cls.model_fields.items()})
        return out

    def term(self, name: str) -> object:
        """The field ``name``, whichever part holds it (None where that part is absent)."""
        part = getattr(self, self.PART_OF[name])
        return None if part is None else getattr(part, name)

    def with_terms(self, **terms: object) -> HardwareSpec:
        """This hardware with the named fields replaced, whichever part holds them: how a fit,
        an override or a study sets a coefficient by its name."""
        parts: dict[str, dict[str, object]] = {}
        own = {}
        for name, value in terms.items():
            if name in type(self).model_fields and name not in self.PARTS:
                own[name] = value
            elif name in self.PART_OF:
                parts.setdefault(self.PART_OF[name], {})[name] = value
            else:
                raise ValueError(f"hardware has no term {name!r}")
        for part, fields in parts.items():
            current = getattr(self, part)
            if part == "cpu" and "matmul" in fields and fields["matmul"] is None:
                own[part] = None  # no measured products: no CPU part
            elif current is not None:  # validated: a copy's update is not
                own[part] = type(current).model_validate({**dict(current), **fields})
            elif "matmul" in fields:
                own[part] = CpuTerms(**fields)
            else:
                raise ValueError(f"{', '.join(fields)}: a CPU term, and {self.name} has no "
                                 "measured products")
        changed = self.model_copy(update=own)
        if changed.graphs.cuda_graphs and changed.cpu is not None:  # modes, engines, overrides
            raise ValueError(f"{self.name} is a CPU: CUDA graphs (graphs mode, vLLM's engine) "
                             "replay on a GPU")
        return changed

    def with_host_speed(self, speed: float) -> HardwareSpec:
        """This hardware with a host ``speed`` times faster: every host time (per call, per
        layer, per operation launched or replayed) divided by it, the device's untouched."""
        if not speed > 0:
            raise ValueError(f"host speed must be a positive factor, got {speed}")
        return self.with_terms(**{name: value / speed for part in (self.host, self.graphs)
                                  for name, value in part if name.endswith("_s")
                                  and value is not None})

    def with_device_speed(self, speed: float) -> HardwareSpec:
        """This hardware with a device ``speed`` times faster: its bandwidth and flops times it,
        its measured products, per-key-set and per-kernel device times divided by it, the
        host's untouched."""
        if not speed > 0:
            raise ValueError(f"device speed must be a positive factor, got {speed}")
        r, cpu = self.roofline, self.cpu
        return self.with_terms(
            memory_bandwidth_bytes_per_s=r.memory_bandwidth_bytes_per_s * speed,
            peak_flops_per_s={k: v * speed for k, v in r.peak_flops_per_s.items()},
            kernel_device_s=r.kernel_device_s / speed,
            **({} if cpu is None else {"matmul_time_scale": cpu.matmul_time_scale / speed,
                                       "attention_key_set_s": cpu.attention_key_set_s / speed}))

    @property
    def mode(self) -> str:
        return "graphs" if self.graphs.cuda_graphs else "eager"

    def in_mode(self, mode: str | None) -> HardwareSpec:
        """This hardware running in ``mode`` ("eager" or "graphs"; None: as it is)."""
        if mode is None or mode == self.mode:
            return self
        if mode not in ("eager", "graphs"):
            raise ValueError(f"unknown mode {mode!r}; use eager or graphs")
        return self.with_terms(cuda_graphs=mode == "graphs")

    @property
    def kernel_overhead_s(self) -> float:
        """The host's time per kernel in this mode: launched eagerly, or replayed."""
        return (self.graphs.graph_launch_overhead_s if self.graphs.cuda_graphs
                else self.host.launch_overhead_s)

    @property
    def call_overhead_s(self) -> float:
        """The host's time per call of a part in this mode, outside its layers and kernels."""
        if self.graphs.cuda_graphs and self.graphs.graph_host_overhead_s is not None:
            return self.graphs.graph_host_overhead_s
        return self.host.host_overhead_s

    @property
    def layer_host_s(self) -> float:
        """The host's time per layer of a call: eager's dispatch; none in a replayed graph."""
        return 0.0 if self.graphs.cuda_graphs else self.host.layer_overhead_s

    def achievable_flops_per_s(self, dtype: str) -> float:
        peaks = self.roofline.peak_flops_per_s
        if dtype not in peaks:
            raise ValueError(f"hardware {self.name} has no peak flops for {dtype} (has "
                             f"{', '.join(sorted(peaks))})")
        return peaks[dtype] * self.roofline.flops_efficiency
