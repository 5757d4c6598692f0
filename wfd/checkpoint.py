"""Build, load and save looped models.

A checkpoint folder holds config.json and model.safetensors, or shards listed in
model.safetensors.index.json, with the release's tensor names. No pickle is read and no code
from the folder is run. fp32 or bf16 on disk is cast to the requested dtype.

Model names: a checkpoint folder; a shipped tiny model (``huginn-tiny``, ``ouro-tiny``); or
``PRESET:random`` for random weights of any cost-model preset's architecture (for timing).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from costmodel.presets import MODELS
from costmodel.trace import atomic_write

from .config import ConfigError, ModelConfig
from .huginn import HuginnModel
from .layers import RMSNorm
from .ouro import OuroModel
from .runtime import free_memory_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}  # torch dtype -> its name here
SHIPPED_DIR = Path(__file__).parent / "models"
# Tensors a release may carry that the model recomputes or ties.
_OPTIONAL = {"freqs_cis"}


class CheckpointError(ValueError):
    """A model name or folder that cannot be loaded, with the reason in one line."""


class _NoInit(TorchFunctionMode):
    """Leaves out ``torch.nn.init``'s draws: a model made on the meta device for a checkpoint's
    weights needs none, and the first such draw on meta imports torch._dynamo (about 2 s of
    every `wfd` command's start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build(cfg: ModelConfig, *, init_scale: float = 1.0, seed: int = 0,
          device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    cls = HuginnModel if cfg.family == "huginn" else OuroModel
    device = torch.device(device)
    if device.type != "meta":  # made in fp32, then cast a parameter at a time: fp32's bytes
        need = cfg.to_spec(cfg.family).num_params * 4
        free = free_memory_bytes(device)
        if need > free:
            raise CheckpointError(f"the weights need {need / 1e9:.1f} GB to load (made in fp32, "
                                  f"then cast) and the {device.type} has {free / 1e9:.1f} GB free")
    with torch.device(device), _NoInit() if device.type == "meta" else nullcontext():
        model = cls(cfg, init_scale=init_scale, seed=seed)
    return model.to(dtype).eval()


def init_random(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights (norm gains 1, matrices ~ N(0, 1/fan_in)): enough to time real sizes and
    to test exactness. Drawn on the model's device (a seed gives the same model on every machine
    of a kind, and a GPU draws a 3.5B model far faster than a CPU)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in norm_weights:
                p.fill_(1.0)
                continue
            std = 1.0 / p.shape[-1] ** 0.5 if p.ndim >= 2 else 0.02
            p.copy_((torch.randn(p.shape, generator=gen, device=device) * std).to(p.dtype))
    return model


def save(model: nn.Module, folder: str | Path, *, dtype: str | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # a tied head is written twice, as in the Huginn release
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
    tmp = folder / ".model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    config = {**model.config.to_hf(),
              "torch_dtype": str(DTYPES[dtype or "fp32"]).removeprefix("torch.")}
    atomic_write(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return folder


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not valid JSON (not text)") from None
    try:
        return ModelConfig.from_hf(raw)
    except (ConfigError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):  # not JSON, not text, or not an index
            raise CheckpointError(f"{index} is not a safetensors index") from None
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has no model.safetensors nor a sharded index")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} lacks the shard(s) {', '.join(missing)}")
    return files


def load_state(folder: Path, device: str | torch.device, dtype: torch.dtype
               ) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = f.get_tensor(key)
                    if not tensor.is_floating_point() and key not in _OPTIONAL:  # a cast hides it
                        raise CheckpointError(f"{path.name}: {key} holds {tensor.dtype} values, "
                                              "not floating-point weights")
                    state[key] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path.name} is not a readable safetensors file ({exc})") \
                from None
    return state


def load_folder(folder: str | Path, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, init_scale: float = 1.0,
                seed: int = 0) -> nn.Module:
    folder = Path(folder)
    cfg = read_config(folder)
    model = build(cfg, init_scale=init_scale, seed=seed, device="meta", dtype=dtype)
    state = load_state(folder, device, dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    head_key = "lm_head.weight"
    if cfg.tied_head:
        # the tied head may be stored (Huginn's release stores a copy) or not
        embed_key = "transformer.wte.weight" if cfg.family == "huginn" else \
            "model.embed_tokens.weight"
        stored_head = state.pop(head_key, None)
        if stored_head is not None and embed_key in state and not torch.equal(
                stored_head, state[embed_key]):
            raise CheckpointError(f"{folder}: {head_key} differs from {embed_key} in a model "
                                  "with tied embeddings")
        expected.pop(head_key, None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - _OPTIONAL)
    differ = [f"{what} {', '.join(names[:5])}" + " ..." * (len(names) > 5)
              for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
    if differ:
        raise CheckpointError(f"{folder} does not match a {cfg.family} model of its config: "
                              + "; ".join(differ))
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(shape)})"
             for k, shape in expected.items() if state[k].shape != shape]
    if wrong:
        raise CheckpointError(f"{folder}: mis-shaped tensors: {', '.join(wrong[:5])}")
    for key in _OPTIONAL:
        state.pop(key, None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tied_head:
        model.lm_head.weight = (model.transformer.wte.weight if cfg.family == "huginn"
                                else model.model.embed_tokens.weight)
    return model.eval()


def shipped_models() -> list[str]:
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


def known_names() -> list[str]:
    return shipped_models() + [f"{name}:random" for name in MODELS]


def load_model(name: str, *, device: str | torch.device = "cpu", dtype: str = "fp32",
               init_scale: float = 1.0, seed: int = 0) -> nn.Module:
    """A model by name: a checkpoint folder, a shipped tiny model, or PRESET:random."""
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if name.endswith(":random"):
        preset = name.removesuffix(":random")
        if preset not in MODELS:
            raise CheckpointError(f"unknown preset {preset!r} for random weights; known: "
                                  f"{', '.join(MODELS)}")
        cfg = ModelConfig.from_spec(MODELS[preset])
        model = build(cfg, init_scale=init_scale, seed=seed, device=device, dtype=torch_dtype)
        return init_random(model, seed)
    path = Path(name)
    if not path.is_dir() and (SHIPPED_DIR / name).is_dir():
        path = SHIPPED_DIR / name
    if not path.is_dir():
        raise CheckpointError(f"no model {name!r}: not a folder, and not one of "
                              f"{', '.join(known_names())}")
    return load_folder(path, device=device, dtype=torch_dtype, init_scale=init_scale, seed=seed)
