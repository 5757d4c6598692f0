"""The config hook vLLM runs for each looped architecture where it makes an engine's config:
what the plugin's options need of vLLM's settings, checked and set before any engine starts."""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .ahead import speculative_config
from .exits import EngineExits, ExitParams


class ScheduleHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``), run where the engine's
    config is made: a schedule the checkpoint cannot run is refused there, in one line, and WFD
    gets whole prompts (no chunked prefill: a wave starts from the whole prompt) and no prefix
    caching (a new request's prefill must start from position 0, where its wave starts), and
    the speculative config that carries the tokens its waves commit ahead (``ahead``)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        cfg = vllm_config.model_config.hf_config
        if vllm_config.speculative_config is not None:
            _ = cfg.drafter  # a draft depth the checkpoint cannot run: refused here
        # what each request's own exit rule is checked against where vLLM admits it
        ExitParams.engine = EngineExits.of(cfg)
        if getattr(cfg, "wave", None) is None:
            return
        if vllm_config.speculative_config is not None:
            raise ValueError(f"schedule {cfg.schedule} drafts for itself: leave out "
                             "speculative_config (commit_ahead sets its own)"
                             if cfg.schedule != "ar" else "an exit rule runs in the plugin's "
                             "own schedules (ar, dtv, wfd): leave out speculative_config")
        device = getattr(vllm_config.device_config, "device_type", "cpu")
        if device != "cpu":  # it reads the paged cache in the CPU backend's layout
            raise ValueError(f"schedule {cfg.schedule} runs on vLLM's CPU build for now, not "
                             f"on {device}")
        vllm_config.cache_config.enable_prefix_caching = False
        scheduler = vllm_config.scheduler_config
        scheduler.enable_chunked_prefill = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens,
                                               vllm_config.model_config.max_model_len)
        if cfg.commit_ahead:  # tokens a wave commits ahead reach vLLM as speculative ones
            vllm_config.speculative_config = speculative_config(vllm_config, cfg.commit_ahead)
