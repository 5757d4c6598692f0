"""The plugin's options as its config reads them (no engine): the schedules it runs and what it
refuses, each in one line (wfd.serving.configs, wfd.serving.wave)."""

import importlib.util

import pytest

# vLLM is imported by the first test that needs it, not at collection: a test worker that runs
# none of these does without its seconds of imports
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: the plugin's tests need the serve-cpu extra (README)")


def config(**options):
    """The plugin's config (``wfd.serving.configs.RavenConfig``) of huginn-tiny with
    ``options``."""
    import json

    from wfd.checkpoint import SHIPPED_DIR
    from wfd.serving.configs import RavenConfig

    raw = json.loads((SHIPPED_DIR / "huginn-tiny" / "config.json").read_text())
    return RavenConfig(**{**raw, **options})


@pytest.mark.parametrize("options, message", [
    ({"schedule": "wfd", "draft_depth": 8}, r"draft_depth must be in 1\.\.7"),
    ({"schedule": "wfd", "kv_sharing": 2}, "schedule wfd keeps a KV slot per depth"),
    ({"schedule": "wfd", "width_cap": 0}, "width_cap must be at least 1"),
    ({"schedule": "dtv", "block_length": 0}, "block_length must be at least 1"),
    ({"schedule": "beam"}, "schedule must be ar, dtv or wfd"),
])
def test_a_schedule_it_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        _ = config(**options).wave


def test_wfd_and_dtv_read_out_at_two_depths_and_ar_at_one():
    ar, wfd = config(), config(schedule="wfd", draft_depth=2, width_cap=3)
    dtv = config(schedule="dtv", draft_depth=1, block_length=3)
    assert ar.wave is None
    assert (wfd.wave.name, wfd.wave.draft_depth, wfd.wave.width_cap) == ("wfd", 2, 3)
    assert (dtv.wave.name, dtv.wave.draft_depth, dtv.wave.block_length) == ("dtv", 1, 3)
    assert dtv.kv_layers == wfd.kv_layers
    coda = ar.looped.coda_layers
    assert coda > 0 and wfd.kv_layers == ar.kv_layers + coda  # the coda's caches at d


@pytest.mark.parametrize("options, message", [
    ({"exit_rule": "gate:0.5"}, r"the gate exit rule needs a model with an exit gate"),
    ({"exit_rule": "kl:-1"}, "exit threshold must be a positive finite number"),
    ({"exit_rule": "stop"}, "unknown exit rule 'stop'"),
    ({"exit_rule": "kl", "exit_min_depth": 9}, r"exit_min_depth must be in 1\.\.8"),
    ({"exit_rule": "none", "exit_min_depth": 0}, r"exit_min_depth must be in 1\.\.8"),
    ({"exit_rule": "forced:2:0.5,9:0.5"}, r"exit depth 9 outside 1\.\.8"),
    ({"exit_rule": "forced:2:0.5,4:0.5", "exit_min_depth": 2}, "forced exit depths are their"),
])
def test_an_exit_rule_it_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        _ = config(**options).kv_layers


def test_exits_read_out_at_every_depth_they_may_stop_at():
    """AR with an exit rule runs as a wave (the AR plan, with the rule's checks); the coda
    keeps caches for R, then the draft depth and every depth from the minimum exit depth."""
    ar = config()
    exits = config(exit_rule="kl:0.01", exit_min_depth=3)
    assert exits.wave.name == "ar" and exits.exits.label == "kl:0.01 from depth 3"
    assert exits.readout_depths == [8, 3, 4, 5, 6, 7]
    assert exits.kv_layers == ar.kv_layers + 5 * ar.looped.coda_layers
    wfd = config(schedule="wfd", draft_depth=2, exit_rule="none", exit_min_depth=5)
    assert wfd.exits is None and wfd.readout_depths == [8, 2, 5, 6, 7]


def test_a_request_s_own_exit_rule_is_checked_against_the_engine_s():
    """What vLLM's input processor asks of each request (wfd.serving.exits.ExitParams): a rule
    the engine can run, at or above the engine's minimum exit depth; "none" for fixed depth."""
    from types import SimpleNamespace

    from wfd.serving.exits import EngineExits, ExitParams, request_rule

    engine = EngineExits.of(config(exit_rule="kl:0.01", exit_min_depth=2))
    assert request_rule(engine, None).label == "kl:0.01 from depth 2"
    assert request_rule(engine, {"exit": "argmax-stable:2", "exit_min_depth": 4}).label == (
        "argmax-stable:2 from depth 4")
    assert request_rule(engine, {"exit": "none"}) is None
    for asked, message in [({"exit": "gate"}, "needs a model with an exit gate"),
                           ({"exit_min_depth": 1}, r"exit_min_depth must be in 2\.\.8"),
                           ({"exit_min_depth": "two"}, "must be a whole number"),
                           ({"exit": "kl:x"}, "is not a number")]:
        with pytest.raises(ValueError, match=message):
            request_rule(engine, asked)
    fixed = EngineExits.of(config())
    with pytest.raises(ValueError, match="start it with the exit_rule option"):
        request_rule(fixed, {"exit": "kl"})
    by_request = EngineExits.of(config(exit_rule="none"))
    assert request_rule(by_request, {}) is None
    # timing on random weights: depths drawn by position, as `wfd generate --force-exits`
    assert request_rule(by_request, {"exit": "forced:2:0.5,8:0.5"}).label == "forced 2:0.5,8:0.5"
    for asked, message in [({"exit": "forced:2:0.5,8:0.5", "exit_min_depth": 3},
                            "forced exit depths are their own"),
                           ({"exit": "forced:2:0.4"}, "sum to 0.4, not 1")]:
        with pytest.raises(ValueError, match=message):
            request_rule(by_request, asked)
    with pytest.raises(ValueError, match="exit_min_depth goes with an exit rule"):
        request_rule(by_request, {"exit_min_depth": 3})
    ExitParams.engine = engine
    try:
        ExitParams.validate_params(SimpleNamespace(extra_args={"exit": "kl:0.1"}))
        with pytest.raises(ValueError, match="exit gate"):
            ExitParams.validate_params(SimpleNamespace(extra_args={"exit": "gate"}))
    finally:
        ExitParams.engine = None
    ExitParams.validate_params(SimpleNamespace(extra_args={"exit": "gate"}))  # not our engine
    from vllm import SamplingParams

    ExitParams.engine = EngineExits.of(config(schedule="wfd", exit_rule="kl:0.01"))
    try:
        ExitParams.validate_params(SamplingParams(temperature=0))
        ExitParams.validate_params(SamplingParams(temperature=1, extra_args={"exit": "none"}))
        with pytest.raises(ValueError, match="serve plain greedy requests"):
            ExitParams.validate_params(SamplingParams(temperature=1))
    finally:
        ExitParams.engine = None


def test_a_refused_request_ends_the_offline_runner_in_one_line(monkeypatch, capsys):
    """``python -m wfd.serving.offline``: a request vLLM refuses (a server's 400; offline
    vLLM's own exception type, not a ValueError) is one line and exit code 2, not a
    traceback."""
    import sys

    from vllm.exceptions import VLLMValidationError

    from costmodel.clitools import script_main
    from wfd.serving import offline

    def refuse(job, out):
        raise VLLMValidationError("this engine decodes at a fixed depth")

    monkeypatch.setattr(offline, "run_file", refuse)
    monkeypatch.setattr(sys, "argv", ["offline", "job.json", "out.json"])
    with pytest.raises(SystemExit) as stop:
        script_main(offline.main)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: a request was refused: this engine decodes at a fixed depth\n")


def test_the_config_hook_refuses_in_one_line_and_gives_the_wave_whole_prompts():
    """What vLLM runs where it makes the engine's config (wfd.serving.hook.ScheduleHook): a
    draft depth at R refused before any engine starts, and WFD off the CPU build (it reads the
    CPU backend's cache layout); WFD given no prefix caching and no chunked prefill, its token
    budget at least a whole sequence."""
    from types import SimpleNamespace

    pytest.importorskip("vllm.model_executor.models.config")
    from wfd.serving.hook import ScheduleHook

    def engine(cfg, speculative=None, device="cpu"):
        return SimpleNamespace(
            model_config=SimpleNamespace(hf_config=cfg, max_model_len=2048),
            speculative_config=speculative, device_config=SimpleNamespace(device_type=device),
            cache_config=SimpleNamespace(enable_prefix_caching=True),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True,
                                             max_num_batched_tokens=512))

    with pytest.raises(ValueError, match=r"draft_depth must be in 1\.\.7"):
        ScheduleHook.verify_and_update_config(engine(config(draft_depth=8), speculative=object()))
    with pytest.raises(ValueError, match="drafts for itself: leave out speculative_config"):
        ScheduleHook.verify_and_update_config(engine(config(schedule="wfd"), object()))
    with pytest.raises(ValueError, match="an exit rule runs in the plugin's own schedules"):
        ScheduleHook.verify_and_update_config(engine(config(exit_rule="kl"), object()))
    with pytest.raises(ValueError, match="runs on vLLM's CPU build for now, not on cuda"):
        ScheduleHook.verify_and_update_config(engine(config(schedule="wfd"), device="cuda"))
    # (with commit_ahead, the default, it also sets vLLM's speculative config: tested with an
    # engine, in test_serving.py)
    wave = engine(config(schedule="wfd", draft_depth=2, commit_ahead=0))
    ScheduleHook.verify_and_update_config(wave)
    assert wave.speculative_config is None
    assert not wave.cache_config.enable_prefix_caching
    assert not wave.scheduler_config.enable_chunked_prefill
    assert wave.scheduler_config.max_num_batched_tokens == 2048
    plain = engine(config())
    ScheduleHook.verify_and_update_config(plain)
    assert plain.cache_config.enable_prefix_caching  # AR keeps vLLM's defaults


def engine_core_loading_the_plugin():
    """A stand-in for vLLM's engine core process object, built as vLLM builds one: its input
    queue first, then the plugins loaded (ours watches its arrivals), then the model (``own``:
    the flag a model built in its constructor maps)."""
    import queue

    from vllm.v1.engine.core import EngineCoreProc

    from wfd.serving import hook

    class Core(EngineCoreProc):
        def __init__(self):
            self.input_queue = queue.Queue()
            hook.watch_arrivals()
            self.own = hook.arrival_flag()

    return Core()


def _worker_reads_arrivals(answers) -> None:
    """A worker process of the engine core (the model's, on vLLM's CPU build): the flag mapped
    as a wave maps it, read on each question."""
    from wfd.serving import hook

    hook.ARRIVALS[0] = hook.arrival_flag()
    answers.send(hook.ARRIVALS[0] is not None)
    while answers.recv():
        answers.send(hook.arrived())


def test_a_wave_hears_of_requests_arriving_at_the_engine_core_from_its_worker_process():
    """The plugin's waves stop running ahead when the server has a request waiting
    (wfd.serving.hook.arrived): the engine core raises a flag in shared memory while its input
    queue holds a request, set up where the plugin is loaded inside its constructor, and a
    process it starts (where vLLM's CPU build runs the model, even at one rank) maps the flag
    by its parent's process id; the model of an engine core's own process (one rank on a GPU)
    by its own. The flag's file is gone once the queue is used, its mappings kept."""
    import multiprocessing
    import os

    from wfd.serving import hook

    assert hook.arrival_flag() is None  # no engine core here or above
    core = engine_core_loading_the_plugin()
    assert core.own is not None and hook._flag_path(os.getpid()).exists()
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    worker = multiprocessing.get_context("fork").Process(target=_worker_reads_arrivals,
                                                         args=(theirs,))
    worker.start()

    def arrived() -> bool:
        ours.send(True)
        return ours.recv()

    try:
        assert ours.recv()  # mapped
        assert not arrived()
        core.input_queue.put_nowait(("ADD", None))
        assert not hook._flag_path(os.getpid()).exists()
        assert arrived() and core.own[0] == 1
        core.input_queue.put_nowait(("ADD", None))
        core.input_queue.get_nowait()
        assert arrived()  # one still waits
        core.input_queue.get_nowait()
        assert not arrived()
    finally:
        ours.send(False)
        worker.join(timeout=60)


def test_an_engine_core_without_shared_memory_serves_with_no_arrival_flag(tmp_path,
                                                                          monkeypatch):
    """Where the flag's file cannot be made (no shared memory to write to), the engine core's
    queue is left as vLLM made it and the waves hear of no arrival."""
    from wfd.serving import hook

    missing = tmp_path / "none"
    monkeypatch.setattr(hook, "_flag_path", lambda pid: missing / f"wfd-arrivals-{pid}")
    core = engine_core_loading_the_plugin()
    assert core.own is None and "_put" not in vars(core.input_queue)
    core.input_queue.put_nowait(("ADD", None))
    assert core.input_queue.get_nowait() == ("ADD", None)


def test_a_prompt_s_rows_attend_as_one_request_and_a_wave_s_rows_one_each():
    """``runs_of``: consecutive positions of one wave in one layer (a prompt, a verification)
    make one request of vLLM's kernel; a wave's rows at different depths, another wave's rows,
    or a gap in the positions start a new one."""
    pytest.importorskip("vllm")
    from wfd.serving.wave_kv import runs_of

    a, b = object(), object()
    prompt = [(a, p) for p in range(5)]
    assert runs_of(prompt, [[3] * 5, [4] * 5]) == [(0, 5)]
    # a wave at depths 2, 4, 6 (different layers), then another wave's prompt of two
    rows = [(a, 7), (a, 8), (a, 9), (b, 0), (b, 1)]
    layers = [[10, 20, 30, 1, 1], [11, 21, 31, 2, 2]]
    assert runs_of(rows, layers) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert runs_of([(a, 0), (a, 2)], [[1, 1]]) == [(0, 1), (1, 2)]
    assert runs_of([], [[]]) == []
