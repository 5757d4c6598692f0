"""Model and hardware presets.

Model shapes come from ../shared/reference/huginn.md and ouro.md; parameter counts and KV bytes
are derived by ``LoopedModelSpec`` and checked against the published figures in the tests.
Hardware figures are the datasheet table of reference/landscape.md (dense matrix flops). GPUs
launch asynchronously, so their overheads overlap the device's work. The efficiency and overhead
values are priors (landscape.md: 70-93% of peak bandwidth is achievable;
4-6 us per launch on a fast host); `costmodel calibrate` replaces them with measured ones.
"""

from __future__ import annotations

from .specs import HardwareSpec, LoopedModelSpec

MODELS: dict[str, LoopedModelSpec] = {
    "huginn-3.5b": LoopedModelSpec(
        name="huginn-3.5b", family="huginn", hidden_size=5280, num_heads=55, num_kv_heads=55,
        head_dim=96, mlp_size=17920, vocab_size=65536, tied_head=True, prelude_layers=2,
        core_layers=4, coda_layers=2, qk_bias=True, default_depth=32,
        default_acceptance=0.94, default_draft_depth=4, max_position_embeddings=4096),
    "ouro-1.4b": LoopedModelSpec(
        name="ouro-1.4b", family="ouro", hidden_size=2048, num_heads=16, num_kv_heads=16,
        head_dim=128, mlp_size=5632, vocab_size=49152, tied_head=False, prelude_layers=0,
        core_layers=24, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=65536),
    "ouro-2.6b": LoopedModelSpec(
        name="ouro-2.6b", family="ouro", hidden_size=2048, num_heads=16, num_kv_heads=16,
        head_dim=128, mlp_size=5632, vocab_size=49152, tied_head=False, prelude_layers=0,
        core_layers=48, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=65536),
    # Scaled-down architectures of the same families, for laptops and CPU timing: "tiny" is the
    # shape of the shipped trained models, "small" about 100 MB, "base" about 230 MB, "mid"
    # about 420 MB (bandwidth-bound on a CPU).
    # Their acceptance defaults are the family's published figures above, not measurements.
    "huginn-tiny": LoopedModelSpec(
        name="huginn-tiny", family="huginn", hidden_size=192, num_heads=3, num_kv_heads=3,
        head_dim=64, mlp_size=512, vocab_size=256, tied_head=True, prelude_layers=1,
        core_layers=2, coda_layers=1, qk_bias=True, default_depth=8,
        default_acceptance=0.94, default_draft_depth=2, max_position_embeddings=2048),
    "ouro-tiny": LoopedModelSpec(
        name="ouro-tiny", family="ouro", hidden_size=192, num_heads=3, num_kv_heads=3,
        head_dim=64, mlp_size=512, vocab_size=256, tied_head=False, prelude_layers=0,
        core_layers=3, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=2048),
    # The tiny Huginn shape at width 64: matrix products too small to matter, every call bound by
    # per-operation overhead (docs/decoding.md times the schedules on it).
    "huginn-nano": LoopedModelSpec(
        name="huginn-nano", family="huginn", hidden_size=64, num_heads=1, num_kv_heads=1,
        head_dim=64, mlp_size=176, vocab_size=256, tied_head=True, prelude_layers=1,
        core_layers=2, coda_layers=1, qk_bias=True, default_depth=8,
        default_acceptance=0.94, default_draft_depth=2, max_position_embeddings=2048),
    "huginn-small": LoopedModelSpec(
        name="huginn-small", family="huginn", hidden_size=512, num_heads=8, num_kv_heads=8,
        head_dim=64, mlp_size=1408, vocab_size=256, tied_head=True, prelude_layers=2,
        core_layers=4, coda_layers=2, qk_bias=True, default_depth=32,
        default_acceptance=0.94, default_draft_depth=4, max_position_embeddings=4096),
    "ouro-small": LoopedModelSpec(
        name="ouro-small", family="ouro", hidden_size=512, num_heads=8, num_kv_heads=8,
        head_dim=64, mlp_size=1408, vocab_size=256, tied_head=False, prelude_layers=0,
        core_layers=8, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=4096),
    "huginn-base": LoopedModelSpec(
        name="huginn-base", family="huginn", hidden_size=768, num_heads=12, num_kv_heads=12,
        head_dim=64, mlp_size=2112, vocab_size=256, tied_head=True, prelude_layers=2,
        core_layers=4, coda_layers=2, qk_bias=True, default_depth=32,
        default_acceptance=0.94, default_draft_depth=4, max_position_embeddings=4096),
    "ouro-base": LoopedModelSpec(
        name="ouro-base", family="ouro", hidden_size=768, num_heads=12, num_kv_heads=12,
        head_dim=64, mlp_size=2112, vocab_size=256, tied_head=False, prelude_layers=0,
        core_layers=8, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=4096),
    "huginn-mid": LoopedModelSpec(
        name="huginn-mid", family="huginn", hidden_size=1024, num_heads=16, num_kv_heads=16,
        head_dim=64, mlp_size=2816, vocab_size=256, tied_head=True, prelude_layers=2,
        core_layers=4, coda_layers=2, qk_bias=True, default_depth=32,
        default_acceptance=0.94, default_draft_depth=4, max_position_embeddings=4096),
    "ouro-mid": LoopedModelSpec(
        name="ouro-mid", family="ouro", hidden_size=1024, num_heads=16, num_kv_heads=16,
        head_dim=64, mlp_size=2816, vocab_size=256, tied_head=False, prelude_layers=0,
        core_layers=8, coda_layers=0, exit_gate=True, default_depth=4,
        default_acceptance=0.92, default_draft_depth=1, max_position_embeddings=4096),
}

_TB = 1e12
_GB = 1e9


def _gpu(name: str, memory_gb: float, bandwidth_gb_s: float, bf16_tflops: float,
         fp32_tflops: float) -> HardwareSpec:
    return HardwareSpec(
        name=name,
        memory_bandwidth_bytes_per_s=bandwidth_gb_s * _GB,
        peak_flops_per_s={"bf16": bf16_tflops * _TB, "fp16": bf16_tflops * _TB,
                          "fp32": fp32_tflops * _TB},
        memory_capacity_bytes=memory_gb * _GB,
        overhead_overlaps=True,  # asynchronous launches
    )


HARDWARE: dict[str, HardwareSpec] = {
    "a6000": _gpu("a6000", 48, 768, 154.8, 38.7),
    "a100-40g": _gpu("a100-40g", 40, 1555, 312, 19.5),
    "a100-80g": _gpu("a100-80g", 80, 2039, 312, 19.5),
    "h100-sxm": _gpu("h100-sxm", 80, 3350, 989, 67),
    "h100-pcie": _gpu("h100-pcie", 80, 2000, 756, 51),
    "h200": _gpu("h200", 141, 4800, 989, 67),
    "l40s": _gpu("l40s", 48, 864, 362, 91.6),
    "rtx4090": _gpu("rtx4090", 24, 1008, 165, 82.6),
    "mi300x": _gpu("mi300x", 192, 5300, 1307, 163.4),
    "b200": _gpu("b200", 180, 7700, 2250, 80),
}


class UnknownPresetError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; a preset error should read plainly
        return str(self.args[0])


def get_model(name: str) -> LoopedModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None
