"""The KV of the depths an exited token skips, under both rules: ``latest`` (its KV at its exit
depth copied into the deeper slots) and ``reference`` (the public Huginn code's: absent from the
deeper steps' keys, one coda slot holding its final readout), and what a batch's exits cost in
calls (in step, as wfd's batch runs them, or continuously, as the vLLM plugin does)."""

import pytest
from conftest import model_for, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel import AR
from costmodel.adaptive import ExitProfile
from costmodel.exits import ExitRule, parse_exit_depths
from wfd.generate import GenerationError, generate


def run(model, prompt, schedule="ar", **options):
    return generate(model, prompt, schedule=schedule, record=False, **options)


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_a_later_position_reads_an_exited_positions_deepest_kv(family):
    """The KV rule: after a run with exits, each decoded position's core slots past its exit
    depth hold its KV at the exit depth, in every layer (and the coda's, where it attends)."""
    model = model_for(family, True)
    prompt = [5, 9, 33, 2, 17]
    res = generate(model, prompt, max_new_tokens=16, exit_rule=ExitRule.parse(
        "latent-diff:0.3" if family == "huginn" else "gate:0.3"))
    cache, depth = res.cache, model.config.depth
    exits = res.stats["exit_depths"]
    assert min(exits) < depth
    for i, e in enumerate(exits):
        p = len(prompt) + i
        for layer in cache.core:
            for r in range(e + 1, depth + 1):
                assert layer.keys[r - 1, :, p].equal(layer.keys[e - 1, :, p])
                assert layer.values[r - 1, :, p].equal(layer.values[e - 1, :, p])
        for layer in cache.coda:
            for r, slot in cache.coda_slot_of.items():
                if r > e:
                    assert layer.keys[slot, :, p].equal(layer.keys[cache.coda_slot(e), :, p])



def test_the_reference_kv_rule_masks_exited_keys_and_keeps_one_coda_slot():
    """The public Huginn code's rule (``--exit-kv reference``): an exited position is absent
    from the keys of the core slots it skipped (attention masks it), while it counts as held
    there so that the next position leaves no hole; a rollback makes it present again; the
    coda keeps one slot, every readout depth's."""
    import torch

    from wfd.cache import KVCache
    from wfd.layers import CallPlan

    cache = KVCache(prelude_layers=1, core_layers=2, coda_layers=1, depth=4, kv_sharing=0,
                    readout_depths=[2, 3, 4], kv_heads=1, head_dim=4, max_len=8,
                    dtype=torch.float32, device="cpu", exit_kv="reference")
    assert {cache.coda_slot(r) for r in (2, 3, 4)} == {0} and len(cache.coda[0].keys) == 1
    for r in range(1, 5):  # positions 0 and 1 (a prompt) at every depth
        cache.claim("block", cache.slots("block", [r, r]), [0, 1])
    for r in (1, 2):  # position 2 exits at depth 2
        cache.claim("block", cache.slots("block", [r]), [2])
    cache.exit(2, 2)
    assert cache.presence[:, 2].tolist() == [True, True, False, False]
    cache.claim("block", cache.slots("block", [4]), [3])  # no hole: 2 is held, absent
    plan = CallPlan.make(torch.tensor([3]), (3,), torch.tensor([3]),
                         torch.ones(2), span=4, presence=cache.presence)
    assert plan.mask.tolist() == [[True, True, False, True]]
    cache.truncate(2)
    assert cache.presence[:, 2].all()
    with pytest.raises(ValueError, match="a slot per depth"):
        KVCache(prelude_layers=1, core_layers=1, coda_layers=0, depth=4, kv_sharing=2,
                readout_depths=[4], kv_heads=1, head_dim=4, max_len=8, dtype=torch.float32,
                device="cpu", exit_kv="reference")


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_the_reference_kv_rule_runs_alike_eager_static_and_batched(family):
    """AR with exits under the reference rule: the same tokens and exit depths in eager and
    static mode and in a batch; a rule that never exits early gives fixed-depth AR's tokens;
    where tokens exit, a state rule reads a token out once (at its exit), not at every
    depth."""
    from wfd.batch import Request, decode_batch

    model = model_for(family, True)
    # rules on the states (no readout before the exit) that exit at a spread of depths
    rule = {"huginn": "latent-diff:0.3", "ouro": "gate:0.3"}[family]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    eager = [run(model, p, max_new_tokens=12, exit_rule=rule, exit_kv="reference")
             for p in prompts]
    static = [run(model, p, max_new_tokens=12, exit_rule=rule, exit_kv="reference",
                  mode="static") for p in prompts]
    batch = decode_batch(model, [Request(i, p, 12) for i, p in enumerate(prompts)],
                         schedule="ar", batch_size=2, exit_rule=rule, exit_kv="reference")
    assert [r.tokens for r in static] == [r.tokens for r in eager]
    assert [r.tokens for r in sorted(batch.results, key=lambda r: r.index)] == [
        r.tokens for r in eager]
    depths = [d for r in eager for d in r.stats["exit_depths"]]
    assert 1 < len(set(depths)) and max(depths) <= model.config.depth
    if family == "huginn":  # a coda call per token (its exit), the prompt's one at R
        codas = [c for c in generate(model, prompts[0], max_new_tokens=12, exit_rule=rule,
                                     exit_kv="reference").records if c.kind == "coda"]
        assert len(codas) == 12
    late = run(model, prompts[0], max_new_tokens=12, exit_rule="kl:1e-30", exit_kv="reference")
    assert late.tokens == run(model, prompts[0], max_new_tokens=12).tokens


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["kl:0.05", "kl:0.5", "entropy-diff:0.05", "argmax-stable:1",
                        "latent-diff:0.3", "latent-diff:0.05"]), st.booleans(),
       st.integers(1, 3), st.sampled_from(["dtv", "wfd"]), st.integers(1, 3),
       st.integers(1, 5), st.one_of(st.none(), st.integers(1, 4)),
       st.lists(st.integers(0, 63), min_size=1, max_size=6))
def test_dtv_and_wfd_under_the_reference_kv_rule_equal_ar_under_it(rule, easy, min_depth,
                                                                  schedule, d, k, cap, prompt):
    """Under the public code's KV rule a younger position's final readout (and a readout rule's
    check) waits for the older ones' final readouts: the tokens and every exit depth are AR's."""
    model = model_for("huginn", easy)
    options = {"max_new_tokens": 14, "exit_rule": rule, "min_depth": min_depth,
               "exit_kv": "reference"}
    ar = run(model, prompt, **options)
    fast = run(model, prompt, schedule, draft_depth=d, block_length=k, width_cap=cap,
               **options)
    assert (fast.tokens, fast.stats["exit_depths"]) == (ar.tokens, ar.stats["exit_depths"])


def test_under_the_reference_kv_rule_a_state_rule_keeps_the_wave_and_a_readout_rule_waits():
    """A rule on the states decides at once, so the wave goes on (fewer block calls than AR);
    a rule on the readouts decides once the older tokens are final, so a younger position
    waits at its first checked depth: no block call holds two positions past it."""
    model, prompt = model_for("huginn", True), [3, 1, 4, 1, 5]
    options = {"max_new_tokens": 16, "exit_kv": "reference"}

    def blocks(schedule, rule):
        return [c for c in generate(model, prompt, schedule=schedule, exit_rule=rule,
                                    **options).records if c.kind == "block"]
    assert len(blocks("wfd", "latent-diff:0.05")) < 0.8 * len(blocks("ar", "latent-diff:0.05"))
    waves = [c for c in blocks("wfd", "kl:0.05") if c.positions[0] >= len(prompt)]
    assert max(len(c.positions) for c in waves) > 1
    assert all(sum(r > 1 for r in c.depths) <= 1 for c in waves)


@pytest.mark.parametrize("settings, message", [
    ({"exit_kv": "reference"}, "goes with an exit rule"),
    ({"exit_rule": "kl", "exit_kv": "reference", "schedule": "wfd", "draft_rule": "kl:0.5"},
     "no draft rule"),
    ({"exit_rule": "kl", "exit_kv": "reference", "kv_sharing": 2}, "a KV slot per depth"),
    ({"exit_rule": "kl", "exit_kv": "nearest"}, "the exit KV rule must be latest or reference"),
])
def test_the_reference_kv_rule_is_refused_where_it_cannot_run(settings, message):
    with pytest.raises(GenerationError, match=message):
        run(tiny_model("huginn"), [1, 2, 3], max_new_tokens=2, **settings)


def test_the_reference_parity_runs_where_the_reference_is_set_up(tmp_path):
    """bench/reference_exits.py in the scratch environment named by WFD_REFERENCE_PYTHON (its
    python, with transformers 4.53.x) and WFD_HUGINN_REFERENCE (the folder of the reference's
    raven_modeling_minimal.py): tokens equal the public code's adaptive compute in every
    case. Skipped where they are not set (CI: the reference is not shipped)."""
    import os
    import subprocess
    from pathlib import Path

    python, folder = os.environ.get("WFD_REFERENCE_PYTHON"), os.environ.get(
        "WFD_HUGINN_REFERENCE")
    if not (python and folder):
        pytest.skip("the reference is not set up (WFD_REFERENCE_PYTHON, WFD_HUGINN_REFERENCE)")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([python, str(root / "bench" / "reference_exits.py"), "--huginn-ref",
                           folder], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_batch_in_step_takes_a_block_call_while_any_token_goes_on():
    """AR with exits in a batch (wfd's: its sequences in step): the call at depth r runs while
    any sequence's token is still there, 1 - (1 - P(e >= r))^B a round, as the closed form
    prices it (``AR.exit_groups``); continuous depth batching (the plugin on vLLM) takes the
    mean exit depth in block calls a round, each over every sequence."""
    from wfd.batch import Request, decode_batch

    model, batch, new = tiny_model("huginn"), 8, 48
    spread = "2:0.5,3:0.3,8:0.2"
    # prompts of different lengths: the forced exit depths are drawn per position
    run = decode_batch(model, [Request(i, list(range(1, 3 + i)), new) for i in range(batch)],
                       schedule="ar", batch_size=batch, force_exits=spread, record=True)
    rounds = new - 1  # the first token is the prefill's
    decode_blocks = sum(1 for c in run.records if c.kind == "block"
                        and len(c.positions) == len(set(c.sequences)))  # a row a sequence
    profile = ExitProfile.from_distribution(parse_exit_depths(spread, model.config.depth),
                                            model.config.depth, 0.9, True)
    stepped = sum(g.count for g in AR().exit_groups(profile, batch) if g.part == "block")
    assert decode_blocks / rounds == pytest.approx(stepped, rel=0.15)
    assert stepped > sum(g.count for g in AR().exit_groups(profile) if g.part == "block")
    continuous = AR().exit_groups(profile, batch, continuous=True)
    assert sum(g.count for g in continuous if g.part == "block") == pytest.approx(
        profile.mean_depth)


def test_tokens_that_all_stop_at_one_depth_stay_in_step():
    """Continuous depth batching prices a tick's prelude and readout calls for tokens entering
    at random ticks; tokens that all stop at one depth enter together and stay in step, so
    exits forced at R cost AR's calls (the plugin's exit mode at R, before its own time), and a
    spread of depths costs more calls than that."""
    from costmodel import predict

    workload = {"context_length": 32, "new_tokens": 64, "batch_size": 8, "depth": 8}

    def latency(**exits):
        return predict("huginn-tiny", "a6000", {**workload, **exits},
                       continuous_depth=True).schedules["ar"].latency_per_token_s

    assert latency(exit_depths={8: 1.0}) == pytest.approx(latency())
    assert latency(exit_depths={4: 1.0}) < latency()
    assert latency(exit_depths={2: 0.25, 8: 0.75}) > latency(exit_depths={8: 1.0}) * 0.75


def test_a_prompt_s_decoded_tokens_stop_again_where_they_exited():
    """``Plan.exits_from`` (a preempted request's prompt again in the vLLM plugin, its decoded
    tokens behind its own prompt): the prompt's own positions run every step, the decoded ones
    are checked after each step and leave the calls at their exit, as when they were decoded
    (their KV copied where they skipped; the plugin's tests hold the tokens to AR's)."""
    from costmodel.plans import Call, Check, EarlyExit

    plan = AR().plan(5, 4, coda_attends=True, exits=EarlyExit(1, True))
    plan.exits_from = 3  # positions 3 and 4 were decoded: 3 exits at depth 2, 4 runs to R
    steps, reply, blocks, checks = plan.prefill_steps(), None, [], []
    for _ in range(40):
        try:
            event = steps.send(reply)
        except StopIteration:
            break
        reply = None
        if isinstance(event, Call) and event.kind == "block":
            blocks.append(event.positions)
        if isinstance(event, Check):
            checks.append((event.positions, event.depths))
            reply = {3} if event.depths[0] == 2 and 3 in event.positions else set()
    assert blocks == [(0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (0, 1, 2, 4), (0, 1, 2, 4)]
    assert checks == [((3, 4), (1, 1)), ((3, 4), (2, 2)), ((4,), (3,))]


def test_exits_on_vllm_pay_the_wave_s_time_per_tick_as_its_drafting_schedules_do():
    """The plugin runs AR with exits as a wave: with the engine's own time given, its tokens
    pay the time per tick and per wave in a tick (mean exit depth ticks a token) and commit
    ahead as the plugin's WFD does; vLLM's AR at fixed depth pays its step only, in step
    (``wfd``'s batch) nothing changes."""
    from costmodel import predict
    from costmodel.engines import EngineOverheads

    workload = {"context_length": 32, "new_tokens": 64, "batch_size": 16, "depth": 8}
    exits = {**workload, "exit_depths": {2: 0.25, 3: 0.5, 4: 0.25}}
    plain = EngineOverheads(step_s=2.7e-3, per_sequence_s=2e-4)
    ticked = plain.model_copy(update={"tick_s": 3e-4, "wave_tick_s": 1e-4})

    def ar(wl, engine, continuous=True):
        return predict("huginn-tiny", "a6000", wl, engine=engine,
                       continuous_depth=continuous).schedules["ar"]

    assert ar(workload, ticked).latency_per_token_s == ar(workload, plain).latency_per_token_s
    bare = ar(exits, None).latency_per_token_s
    per_tick = ticked.per_tick_s(16) * 3.0  # the mean exit depth's ticks
    assert ar(exits, ticked).latency_per_token_s - ar(exits, plain).latency_per_token_s == (
        pytest.approx(per_tick, rel=1e-6))
    # a wave's step commits ahead: the step's share falls below AR's one token a step
    assert ar(exits, plain).latency_per_token_s - bare < 16 * plain.per_token_s(16, False)
    assert ar(exits, ticked, continuous=False).latency_per_token_s == pytest.approx(
        ar(exits, plain, continuous=False).latency_per_token_s)
