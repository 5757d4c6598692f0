"""Where the plugin hooks into vLLM: the config hook it runs for each looped architecture
where it makes an engine's config (what the plugin's options need of vLLM's settings, checked
and set before any engine starts), and the model runner's methods the waves wrap to learn each
step's requests (``wfd.serving.wave``), with the engine core's queue of arriving ones."""

from __future__ import annotations

import queue
import sys

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .ahead import bound, speculative_config
from .exits import EngineExits, ExitParams

# The engine step's request ids in batch order and each one's bound on tokens committed ahead
# (``ahead.bound``), published by the runner hook before each forward; the requests to forget
# (finished, aborted, preempted) before the next.
BATCH: list[str] = []
BOUNDS: dict[str, tuple[int, int]] = {}
# the model runner's requests by id (each one's sampling parameters and own prompt), read where
# a wave starts
REQUESTS: list[dict | None] = [None]
FORGOTTEN: set[str] = set()
# the engine core's queue of requests arriving from the server (None in-process, where every
# request is added between steps, and on a worker of its own process: tensor parallel)
INBOX: list[queue.Queue | None] = [None]


def engine_inbox() -> queue.Queue | None:
    """The input queue of the engine core being built around the caller (the model is made in
    ``EngineCoreProc.__init__``, on its thread), where the server's requests land mid-step."""
    from vllm.v1.engine.core import EngineCoreProc

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            return owner.input_queue
        frame = frame.f_back
    return None


def install_hooks() -> None:
    """Wrap the model runner's forward (to publish the batch's request ids) and its state
    update (to hear which requests ended or were preempted); once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_wfd_hooks", False):
        return
    forward, update = GPUModelRunner._model_forward, GPUModelRunner._update_states

    def _model_forward(self, *args, **kwargs):
        BATCH[:] = list(self.input_batch.req_ids)
        BOUNDS.clear()
        BOUNDS.update((req, bound(self, req)) for req in BATCH)
        REQUESTS[0] = self.requests
        return forward(self, *args, **kwargs)

    def _update_states(self, scheduler_output):
        FORGOTTEN.update(scheduler_output.finished_req_ids)
        FORGOTTEN.update(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return update(self, scheduler_output)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._wfd_hooks = True


def arrived() -> bool:
    """Whether a request (or another message from the server) waits for the step to end."""
    inbox = INBOX[0]
    return inbox is not None and not inbox.empty()


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
