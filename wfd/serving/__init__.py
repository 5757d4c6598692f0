"""Looped models on vLLM: a plugin that registers Huginn (``RavenForCausalLM``) and Ouro
(``OuroForCausalLM``) with vLLM's model registry, built from vLLM's own layers.

Installed with the ``serve`` extra (``serve-cpu`` for vLLM's CPU build), it is found through
vLLM's ``vllm.general_plugins`` entry point, so ``vllm serve PATH`` and ``LLM(model=PATH)`` load
a checkpoint folder in either family's public layout. Decoding is autoregressive at a fixed
depth, DtV through vLLM's speculative decoding (method ``draft_model`` with the checkpoint
itself as drafter, at its draft depth), or the plugin's own WFD or DtV (``schedule``); each
(recurrence step, core layer) has its own KV cache, as in ``wfd``'s decoder. Options, as
``hf_overrides`` (or keys in config.json):
``recurrence_depth`` (R; default the checkpoint's), ``kv_sharing`` (0: a KV slot per depth; S in
1..R: S shared slots), ``draft_depth`` (DtV's and WFD's d), ``schedule`` ("wfd": WaveFront
Decoding in the engine, with ``width_cap``; "dtv": DtV with nested reuse, with
``block_length``; ``wfd.serving.wave``), ``commit_ahead`` (their greedy tokens committed ahead
of vLLM's sampler, as its speculative tokens; ``wfd.serving.ahead``), and for Huginn
``init_scale`` and ``state_seed`` (its initial state, as ``wfd generate --init-scale --seed``).
"""

from __future__ import annotations

ARCHITECTURES = {"RavenForCausalLM": "wfd.serving.huginn:RavenForCausalLM",
                 "OuroForCausalLM": "wfd.serving.ouro:OuroForCausalLM"}


def register() -> None:
    """Called by vLLM in each of its processes (idempotent): each family's config class where
    vLLM looks up a model_type, each model class in its registry (imported when first used)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils import config as vllm_config

    from .configs import CONFIGS
    from .hook import ScheduleHook, watch_arrivals

    for model_type, config_class in CONFIGS.items():
        vllm_config._CONFIG_REGISTRY[model_type] = config_class
    for architecture, path in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, path)
        MODELS_CONFIG_MAP[architecture] = ScheduleHook
    watch_arrivals()
