"""Where the plugin hooks into vLLM: the config hook it runs for each looped architecture
where it makes an engine's config (what the plugin's options need of vLLM's settings, checked
and set before any engine starts), and the model runner's methods the waves wrap to learn each
step's requests (``wfd.serving.wave``), with the engine core's queue of arriving ones."""

from __future__ import annotations

import atexit
import mmap
import os
import sys
import tempfile
from pathlib import Path

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
# the flag the engine core raises while requests from the server wait in its input queue
# (``watch_arrivals``), mapped where the waves run (``arrival_flag``); None where no engine core
# fills a queue (an engine in the caller's process adds requests between steps) or with tensor
# parallel ranks, which must end a step at the same call
ARRIVALS: list[mmap.mmap | None] = [None]


def _flag_path(pid: int) -> Path:
    """The arrival flag of the engine core process ``pid``: a byte in shared memory, since
    vLLM's CPU build runs the model in a worker process of the engine core's (its
    multiprocessing executor), even at one rank."""
    shared = Path("/dev/shm")
    return (shared if shared.is_dir() else Path(tempfile.gettempdir())) / f"wfd-arrivals-{pid}"


def _open_flag(pid: int, create: bool) -> mmap.mmap | None:
    try:
        fd = os.open(_flag_path(pid), os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except OSError:  # none (a worker of no engine core), or no shared memory to write to
        return None
    try:
        if os.fstat(fd).st_size < 1:
            os.ftruncate(fd, 1)
        return mmap.mmap(fd, 1)
    finally:
        os.close(fd)


def _engine_core_building():
    """The engine core process object whose constructor runs up the caller's stack, if any."""
    from vllm.v1.engine.core import EngineCoreProc

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            return owner
        frame = frame.f_back
    return None


def flag_arrivals(core) -> None:
    """The flag of this process raised while ``core``'s input queue (where the server's
    requests land, mid-step too) holds anything, lowered when it is emptied: its put and get,
    which run under the queue's lock, wrapped on this queue alone. Its file goes at the first
    of them: by then the engine core's workers, started in its constructor, have mapped it.
    Once per queue."""
    inbox = core.input_queue
    if getattr(inbox, "_wfd_flag", None) is not None:
        return
    flag, path = _open_flag(os.getpid(), create=True), _flag_path(os.getpid())
    if flag is None:  # the waves hear of no arrival: steps end as they would without requests
        return
    flag[0] = int(not inbox.empty())  # not a dead engine core's, whose process id this had
    atexit.register(path.unlink, missing_ok=True)  # an engine that never took a request
    put, get, named = inbox._put, inbox._get, [True]

    def unname() -> None:
        if named[0]:
            path.unlink(missing_ok=True)
            named[0] = False

    def _put(item):
        unname()
        put(item)
        flag[0] = 1

    def _get():
        unname()
        item = get()
        if not inbox._qsize():
            flag[0] = 0
        return item

    inbox._put, inbox._get, inbox._wfd_flag = _put, _get, flag


def watch_arrivals() -> None:
    """Flag the arrivals of every engine core process built here: one under construction now
    (the plugin is loaded inside its constructor, before its workers start, where its process
    was spawned) and any built later (here, or in a process forked from here). Once per
    process."""
    from vllm.v1.engine.core import EngineCoreProc

    core = _engine_core_building()
    if core is not None and hasattr(core, "input_queue"):
        flag_arrivals(core)
    if getattr(EngineCoreProc, "_wfd_arrivals", False):
        return
    build = EngineCoreProc.__init__

    def __init__(self, *args, **kwargs):
        _open_flag(os.getpid(), create=True)  # before its workers start, which map it
        build(self, *args, **kwargs)
        flag_arrivals(self)

    EngineCoreProc.__init__ = __init__
    EngineCoreProc._wfd_arrivals = True


def arrival_flag() -> mmap.mmap | None:
    """The flag of the engine core the caller's model is built for: its own process's where
    the model is built inside the engine core's constructor, else its parent's (a worker
    process the engine core started); None where there is no such flag."""
    return _open_flag(os.getpid() if _engine_core_building() is not None else os.getppid(),
                      create=False)


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
    flag = ARRIVALS[0]
    return flag is not None and flag[0] != 0


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
