"""What the `costmodel` commands share: their common options, and the hardware a command's
options describe (a preset or a profile's fitted hardware, with figures overridden)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .clitools import DTYPES, UserError, note, one_of
from .hardware import HardwareSpec
from .presets import get_hardware
from .units import parse_bandwidth, parse_bytes, parse_duration, parse_flops

# Options that several commands share.
ExitRuleOption = Annotated[str | None, typer.Option(
    "--exit", help="adaptive depth: RULE[:THRESHOLD] (kl, entropy-diff, latent-diff, "
    "argmax-stable, gate); the exit depths are read from --depth-trace under it")]
MinDepthOption = Annotated[int, typer.Option(
    help="--exit: the shallowest depth a token may stop at")]
ExitDepthsOption = Annotated[str | None, typer.Option(
    help="adaptive depth: the exit depths' distribution, e.g. \"4:0.3,6:0.5,8:0.2\" "
         "(--acceptance: of the drafts of tokens that go past the draft depth)")]
ModelOption = Annotated[str, typer.Option("--model", help="model preset")]
HardwareOption = Annotated[str, typer.Option("--hardware", help="hardware preset")]
ProfileOption = Annotated[Path | None, typer.Option(
    "--profile", help="calibration profile (JSON): its fitted hardware replaces --hardware")]
ContextOption = Annotated[int, typer.Option("--context", help="prompt/context length in tokens")]
NewTokensOption = Annotated[int, typer.Option("--new-tokens", help="tokens to generate")]
BatchOption = Annotated[int, typer.Option("--batch", help="sequences decoded together")]
DtypeOption = Annotated[str | None, typer.Option(
    "--dtype", help="fp32, bf16, fp16 (default: bf16, or the profile's)")]
JsonOption = Annotated[bool, typer.Option("--json", help="print one JSON object")]
StepOverheadOption = Annotated[str, typer.Option(
    help="a serving engine's own time per step (scheduling, sampling), e.g. 5ms: "
         "bench/serving_load.py measures vLLM's")]
SequenceOverheadOption = Annotated[str, typer.Option(
    help="its time per sequence in a step (sampling, output), e.g. 0.5ms")]
TickOverheadOption = Annotated[str, typer.Option(
    help="DtV and WFD: the engine's own time per tick of a wave (the plugin's bookkeeping), "
         "e.g. 0.3ms: bench/vllm_peer.py measures the plugin's")]
WaveOverheadOption = Annotated[str, typer.Option(
    help="DtV and WFD: its time per wave in a tick, e.g. 0.1ms")]
TensorParallelOption = Annotated[int, typer.Option(
    help="devices each call is split over, as vLLM splits a model (heads, MLP rows, "
         "vocabulary), joined by --link")]
LinkOption = Annotated[str | None, typer.Option(
    help="what joins the devices: nvlink3, nvlink4, nvlink5, infinity-fabric, pcie4, pcie5, "
         "cpu-shm (default: the hardware's usual one)")]
LinkBandwidthOption = Annotated[str | None, typer.Option(
    help="the link's bandwidth per device, one way, e.g. 450GB/s (replaces --link's)")]
LinkLatencyOption = Annotated[str | None, typer.Option(
    help="the link's time per collective, e.g. 8us (replaces --link's)")]
WakeOverheadOption = Annotated[str | None, typer.Option(
    help="the engine's extra time for a request that finds it idle, by how long it idled: "
         "IDLE:EXTRA pairs, e.g. 1s:10ms,4s:35ms (interpolated; bench/serving_load.py "
         "measures a server's)")]
CommitAheadOption = Annotated[int, typer.Option(
    help="DtV and WFD: tokens a step commits ahead of the engine's sampler, beside its one "
         "(the plugin's commit_ahead): the step's time is shared by them")]


def engine_overheads(step: str, sequence: str, request: str = "0s", tick: str = "0s",
                     wave: str = "0s", commit_ahead: int = 8, wake: str | None = None,
                     prompt: str = "0s"):
    """The engine's own time the options give (None where all are zero)."""
    from .engines import EngineOverheads

    if commit_ahead < 0:
        raise UserError(f"--commit-ahead must be at least 0, got {commit_ahead}")
    engine = EngineOverheads(step_s=parse_duration(step),
                             per_sequence_s=parse_duration(sequence),
                             request_s=parse_duration(request), prompt_s=parse_duration(prompt),
                             tick_s=parse_duration(tick),
                             wave_tick_s=parse_duration(wave),
                             commit_ahead=commit_ahead, wake=parse_wake(wake))
    return engine if engine != EngineOverheads(commit_ahead=commit_ahead) else None


def override_hardware(hw: HardwareSpec, bandwidth: str | None, flops: str | None,
                      memory: str | None, launch_overhead: str | None, dtype: str,
                      mode: str | None = None, host_speed: float | None = None
                      ) -> HardwareSpec:
    changes: dict[str, object] = {}
    if bandwidth is not None:
        changes["memory_bandwidth_bytes_per_s"] = parse_bandwidth(bandwidth)
    if flops is not None:
        changes["peak_flops_per_s"] = {**hw.roofline.peak_flops_per_s, dtype: parse_flops(flops)}
    if memory is not None:
        changes["memory_capacity_bytes"] = parse_bytes(memory)
    if launch_overhead is not None:
        changes["launch_overhead_s"] = parse_duration(launch_overhead)
    if mode is not None:
        changes["cuda_graphs"] = one_of("mode", mode, ("eager", "graphs")) == "graphs"
    if host_speed is not None and not host_speed > 0:
        raise UserError(f"host speed must be a positive factor, got {host_speed}")
    if changes or host_speed is not None:
        changes["name"] = f"{hw.name}*"  # the star marks a preset with overridden figures
    hw = hw.with_terms(**changes)
    # the host's share of a call runs host_speed times faster; the device's terms are untouched
    return hw.with_host_speed(host_speed) if host_speed is not None else hw


def at_least_one(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise UserError(f"{name.replace('_', ' ')} must be at least 1, got {value}")


def hardware_of(profile: Path | None, hardware: str, dtype: str | None):
    """(the profile or None, its fitted hardware or the preset, the dtype: given, the
    profile's, or bf16)."""
    prof = None
    if profile is not None:  # a plain predict starts without the profile and trace models
        from .profile import load_profile

        prof = load_profile(profile)
        note_machine(prof, profile)
    dtype = one_of("dtype", dtype or (prof.dtype if prof is not None else "bf16"), DTYPES)
    return prof, prof.hardware if prof is not None else get_hardware(hardware), dtype


def note_machine(profile, path: Path) -> None:
    """A CPU profile carried to another machine predicts the machine it was measured on."""
    from .store import cpu_machine_name

    here = cpu_machine_name()
    if profile.device == "cpu" and profile.machine != here:
        note(f"note: profile {path} was measured on {profile.machine!r}, not this machine "
             f"({here!r}): it predicts that one; calibrate here with `costmodel calibrate`")


def chosen_link(hw: HardwareSpec, link: str | None, bandwidth: str | None = None,
                latency: str | None = None):
    """The link the options name (default: the hardware's usual one), figures overridden."""
    from .links import Link, resolve_link

    chosen = resolve_link(hw, link)
    if bandwidth is None and latency is None:
        return chosen
    return Link(name=f"{chosen.name}*", source=chosen.source,
                bandwidth_bytes_per_s=parse_bandwidth(bandwidth) if bandwidth is not None
                else chosen.bandwidth_bytes_per_s,
                latency_s=parse_duration(latency) if latency is not None
                else chosen.latency_s)


def parallel_devices(spec, hw: HardwareSpec, degree: int, link: str | None,
                     bandwidth: str | None = None, latency: str | None = None,
                     placement: str | None = None):
    """(one device's share of the model, the hardware of ``degree`` such devices over the
    link) the options give; the model and hardware as they are at one device."""
    from .parallel import split

    if degree < 1:
        raise UserError(f"--tensor-parallel must be at least 1, got {degree}")
    if degree == 1:
        if placement is None and (link is not None or bandwidth is not None
                                  or latency is not None):
            raise UserError("a link joins several devices: give --tensor-parallel 2 or more "
                            "(or --placement)")
        return spec, hw
    if placement is not None:
        raise UserError("a placement's devices each hold whole parts: give --placement or "
                        "--tensor-parallel, not both")
    return split(spec, hw, degree, chosen_link(hw, link, bandwidth, latency))


def parse_wake(text: str | None) -> tuple:
    """--wake-overhead's IDLE:EXTRA pairs (e.g. 1s:10ms,4s:35ms), as the engine's wake."""
    from .engines import IdleWake

    if not text:
        return ()
    try:
        pairs = [item.split(":") for item in text.split(",")]
        return tuple(IdleWake(idle_s=parse_duration(idle), extra_s=parse_duration(extra))
                     for idle, extra in pairs)
    except ValueError:
        raise UserError(f"--wake-overhead takes IDLE:EXTRA pairs of durations, idle above "
                        f"0, e.g. 1s:10ms,4s:35ms; got {text!r}") from None


def exit_options(rule: str | None, min_depth: int, exit_depths: str | None, depth: int,
                 exit_kv: str = "latest", depth_trace: Path | None = None
                 ) -> dict[str, object]:
    """The adaptive-depth fields of a workload, checked (one line for a bad one); a rule is
    priced from the exit depths a depth trace gives under it, or from their distribution."""
    if rule is not None and exit_depths is None and depth_trace is None:
        raise UserError("--exit is priced from the exit depths a --depth-trace gives under it "
                        "(or give their distribution: --exit-depths)")
    out: dict[str, object] = {}
    if rule is not None:
        from .exits import ExitRule

        ExitRule.parse(rule, min_depth, exit_kv).for_plan(False, depth)  # a UserError
        out.update(exit_rule=rule, exit_min_depth=min_depth)
    elif min_depth != 1:
        raise UserError("--min-depth goes with --exit")
    if exit_kv != "latest":
        from .exits import check_exit_kv

        check_exit_kv(exit_kv)  # ValueError: a UserError
        if rule is None and exit_depths is None:
            raise UserError("--exit-kv goes with exits (--exit or --exit-depths)")
        out["exit_kv"] = exit_kv
    if exit_depths is not None:
        from .exits import parse_exit_depths

        out["exit_depths"] = parse_exit_depths(exit_depths, depth)
    return out
