import pytest

from costmodel import HARDWARE, MODELS, get_model
from costmodel.presets import UnknownPresetError, get_hardware
from costmodel.store import PROFILES_DIR


def test_parameter_counts_match_the_published_figures():
    assert get_model("huginn-3.5b").num_params == 3_564_976_800
    assert get_model("ouro-1.4b").num_params == 1_434_652_673
    assert get_model("ouro-2.6b").num_params == 2_667_974_657


def test_huginn_parts_match_the_reference_table():
    m = get_model("huginn-3.5b")
    assert m.layer_params == 395_398_080
    assert m.part("block").weight_params == 1_637_349_120  # core + adapter
    assert m.part("prelude").weight_params == 790_796_160


def test_kv_bytes_per_token():
    # Huginn: 2 prelude + 32 x 4 core + 2 coda layer-slots, 2 x 5280 bf16 values each: 2.79 MB
    assert get_model("huginn-3.5b").kv_bytes_per_token("bf16") == 2_787_840
    assert get_model("ouro-1.4b").kv_bytes_per_token("bf16") == 768 * 1024
    assert get_model("ouro-2.6b").kv_bytes_per_token("bf16") == 1536 * 1024


def test_kv_sharing_and_readout_slots():
    m = get_model("huginn-3.5b")
    per_layer = 2 * 5280 * 2
    assert m.kv_bytes_per_token("bf16", kv_sharing=1) == (2 + 4 + 2) * per_layer
    assert m.kv_bytes_per_token("bf16", kv_sharing=4) == (2 + 16 + 2) * per_layer
    assert m.kv_bytes_per_token("bf16", readout_depths=2) == (2 + 128 + 4) * per_layer


def test_hardware_presets_from_the_datasheet_table():
    assert set(HARDWARE) == {"a6000", "a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200",
                             "l40s", "rtx4090", "mi300x", "b200"}
    assert get_hardware("h200").roofline.memory_bandwidth_bytes_per_s == 4.8e12
    assert get_hardware("a6000").roofline.peak_flops_per_s["bf16"] == pytest.approx(154.8e12)


def test_unknown_presets_list_the_known_ones():
    with pytest.raises(UnknownPresetError, match="huginn-3.5b"):
        get_model("gpt-5")
    with pytest.raises(UnknownPresetError, match="a6000"):
        get_hardware("tpu")
    assert "ouro-2.6b" in MODELS


def test_the_eager_host_default_is_what_the_gpu_eager_calibrations_measured():

    from costmodel.hardware import EAGER_HOST_S_PER_OPERATION, Host
    from costmodel.profile import load_profile

    profiles = PROFILES_DIR
    measured = [load_profile(profiles / f"gpu-{family}-bf16.json").hardware.host.launch_overhead_s
                for family in ("huginn", "ouro")]
    assert EAGER_HOST_S_PER_OPERATION == pytest.approx(sum(measured) / 2, rel=1e-3)
    assert Host.model_fields["launch_overhead_s"].default == EAGER_HOST_S_PER_OPERATION


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_every_gpu_preset_prices_eager_and_graphs_apart(name):
    """A preset's eager host pays each of this decoder's dispatched operations; a replay does
    not: Ouro-2.6B, whose layers are small, is host-bound eagerly on every preset."""
    from costmodel import Workload, predict

    hw = get_hardware(name)
    ar = {mode: predict("ouro-2.6b", hw.in_mode(mode), Workload()).schedules["ar"]
          for mode in ("eager", "graphs")}
    assert ar["eager"].latency_per_token_s > 1.2 * ar["graphs"].latency_per_token_s
    assert ar["eager"].bound == "overhead"
    faster = predict("ouro-2.6b", hw.in_mode("eager").with_host_speed(2), Workload())
    assert faster.schedules["ar"].latency_per_token_s < ar["eager"].latency_per_token_s


def test_a_preset_counts_this_decoders_operations():
    """Per layer and outside the layers, as costmodel/data/operations.json stores them: views
    are dispatched (the eager host pays them) but launch no kernel."""
    from costmodel.cost import operations
    from costmodel.specs import decoder_operations

    hw = get_hardware("h200")
    for family, model in (("huginn", "huginn-3.5b"), ("ouro", "ouro-2.6b")):
        counted = decoder_operations(family)
        part = get_model(model).part("block")
        kernels, host = operations(hw, part, 3)
        per_layer, extra = sum(counted["layer"].values()), sum(counted["block"].values())
        assert host == part.layers * per_layer + extra
        assert kernels == host - part.layers * counted["layer"]["view"] - counted["block"]["view"]


def test_every_query_takes_preset_names_or_specs():
    from costmodel import WFD, Workload, predict, recommend, simulate
    from costmodel.simulate import simulate_batch

    spec, hw = get_model("ouro-2.6b"), get_hardware("h200")
    wl = Workload(new_tokens=32)
    assert predict("ouro-2.6b", "h200", wl) == predict(spec, hw, wl)
    curve = {1: 0.9, 2: 0.95}
    assert recommend("ouro-2.6b", "h200", curve, wl) == recommend(spec, hw, curve, wl)
    kw = dict(context_length=64, new_tokens=16, acceptance=0.9, seed=3)
    assert (simulate("ouro-2.6b", "h200", WFD(draft_depth=1), **kw).latency_per_token_s
            == simulate(spec, hw, WFD(draft_depth=1), **kw).latency_per_token_s)
    jobs = [(64, 8, [True] * 8), (32, 6, [False, True] * 3)]
    assert (simulate_batch("ouro-2.6b", "h200", WFD(draft_depth=1), jobs, batch_size=2).calls
            == simulate_batch(spec, hw, WFD(draft_depth=1), jobs, batch_size=2).calls)


def test_a_cpu_spec_has_no_cuda_graphs():
    """Graphs mode replays CUDA graphs: a CPU's spec refuses them however they are asked for (a
    mode, a term); vLLM's engine on a CPU (its CPU build) launches its kernels eagerly, a GPU's
    replays them."""

    from costmodel.engines import for_engine
    from costmodel.profile import load_profile

    cpu = load_profile(PROFILES_DIR
                       / "cpu-ouro-fp32.json").hardware
    assert cpu.in_mode("eager") is cpu
    for ask in (lambda: cpu.in_mode("graphs"), lambda: cpu.with_terms(cuda_graphs=True)):
        with pytest.raises(ValueError, match="is a CPU: CUDA graphs"):
            ask()
    model = get_model("ouro-tiny")
    assert not for_engine("vllm", cpu, model).graphs.cuda_graphs
    assert for_engine("vllm", get_hardware("a6000"), model).graphs.cuda_graphs


def test_the_python_api_says_what_it_takes():
    """A study's script passes names, specs and a workload's fields as a dict; what is none of
    these is a TypeError naming what was expected (it was an AttributeError deep inside)."""
    from costmodel import predict
    from costmodel.recommend import recommend
    from costmodel.simulate import simulate
    from costmodel.workload import Workload

    as_dict = predict("ouro-1.4b", "h200", {"context_length": 2048, "batch_size": 2})
    as_model = predict("ouro-1.4b", "h200", Workload(context_length=2048, batch_size=2))
    assert as_dict.model_dump() == as_model.model_dump()
    with pytest.raises(TypeError, match="model must be a preset's name or a LoopedModelSpec"):
        predict(None, "h200")
    with pytest.raises(TypeError, match="hardware must be a preset's name or a HardwareSpec"):
        predict("ouro-1.4b", 768e9)
    with pytest.raises(TypeError, match=r"schedule must be a Schedule such as AR\(\)"):
        simulate("ouro-1.4b", "h200", "wfd", context_length=16, new_tokens=4)
    with pytest.raises(TypeError, match="acceptance is by draft depth"):
        recommend("ouro-1.4b", "h200", 0.9)
