"""A profile for a machine nobody calibrated, in seconds: a calibrated profile of the same device
kind, its host and device times rescaled to this machine from a few of the decoded model's own
calls timed here (what `wfd generate --schedule auto` needs, where a calibration takes minutes).

The calibrated profile prices each call as host time plus device time; the calls timed here give
``measured = host_factor * host + device_factor * device`` by least squares over shapes that weigh
the two differently. The measured calls are kept as the profile's validation points, so
`costmodel check-profile` can tell when the machine has moved.
"""

from __future__ import annotations

import datetime as dt
import re
import statistics
import time

import numpy as np

from costmodel.profile import CalibrationProfile, ValidationPoint
from costmodel.simulate import price_records

from .timing import Grid, Quiet, time_call, warm_up

# (part, positions, distinct slots): a decode step's calls and a wave's, shapes the two factors
# move apart
SHAPES = (("block", 1, 1), ("block", 8, 1), ("block", 4, 4), ("prelude", 1, 1),
          ("coda", 1, 1), ("coda", 2, 2))
CONTEXT = 64
GRID = Grid(positions=[1], contexts=[CONTEXT], repeats=5, warmup=2)
TOLERANCE = 0.5  # a kept profile whose calls run further than this from their times is remade
RIDGE = 0.05  # how firmly the factors are held at the calls' overall ratio (a call's fit is 1)
RECHECK_S = 3600.0  # a kept profile is checked again at most this often


def _split(profile: CalibrationProfile, point: ValidationPoint) -> tuple[float, float]:
    """(host seconds, device seconds) the profile prices a call at, as its validation does."""
    terms = price_records(point.spec, profile.hardware.in_mode(point.mode),
                          [point.record.model_copy()], dtype=profile.dtype)
    return terms["overhead_s"], sum(terms.values()) - terms["overhead_s"]


def measure_calls(model, name: str, spec, device: str, shapes=SHAPES) -> list[ValidationPoint]:
    """This machine's times of ``shapes`` of the model's calls, timed as the calibration times
    them (warm-up, median of repeats, the canary product around them on a CPU)."""
    quiet = Quiet(device, retries=0 if device.startswith("cuda") else 2, budget_s=5.0)
    warm_up(model, name, 1, CONTEXT)  # the first call timed is not the process's first
    depth = model.config.depth
    points = []
    for kind, n, slots in shapes:
        if kind == "block" and slots > min(n, depth):
            continue
        sample = quiet.measure(lambda c: c.median_s, time_call, model, name, kind, n, CONTEXT,
                               slots, GRID)
        points.append(ValidationPoint(
            kind="call", model=name, spec=spec, group=kind, measured_s=sample.median_s,
            record=sample.record, repeats_s=[sample.median_s],
            label=f"{kind} n={n} context={CONTEXT} slots={slots}"))
    return points


def factors(profile: CalibrationProfile, points: list[ValidationPoint]) -> tuple[float, float]:
    """(host factor, device factor): this machine's times over the profile's, by least squares
    in relative terms (each call weighs alike, whatever its length), held gently at the calls'
    overall ratio (RIDGE), both positive."""
    split = np.array([_split(profile, p) for p in points])
    measured = np.array([p.measured_s for p in points])
    relative = split / measured[:, None]  # a factor pair fits where relative @ pair = 1
    overall = statistics.median(measured / split.sum(axis=1))
    # least squares held gently at the calls' overall ratio: a factor the calls barely see
    # (a host-bound model's device) stays near it instead of trading noise with the other
    weight = np.sqrt(RIDGE) * np.eye(2)
    (host, device), *_ = np.linalg.lstsq(np.vstack([relative, weight]), np.concatenate(
        [np.ones(len(points)), weight @ [overall, overall]]), rcond=None)
    return (host if host > 0 else overall), (device if device > 0 else overall)


def transplant(base: CalibrationProfile, model, name: str, machine: str) -> CalibrationProfile:
    """``base`` rescaled to this machine from the model's own calls timed here."""
    spec = model.config.to_spec(name)
    points = measure_calls(model, name, spec, base.device)
    host, device = factors(base, points)
    hardware = base.hardware.with_host_speed(1 / host).with_device_speed(1 / device)
    hardware = hardware.model_copy(update={
        "name": f"{machine} ({base.device}, rescaled from {base.machine})"})
    check = (f"transplanted: {base.machine}'s profile ({base.created[:10]}) with its host "
             f"{host:.2f}x and its device {device:.2f}x as slow, from {len(points)} calls of "
             f"{name} timed here")
    return base.model_copy(update={
        "hardware": hardware, "machine": machine,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "models": [name], "training": [], "validation": points, "cross_mode": [],
        "checks": [check, *base.checks]})


def still_holds(profile: CalibrationProfile, model, name: str) -> bool:
    """Whether the model's calls still run near the times ``profile`` stored for them (two of
    its points timed again): ``costmodel check-profile``'s question, asked of a transplant."""
    stored = [p for p in profile.validation if p.kind == "call" and p.model == name]
    if not stored:
        return False
    stored = stored[:2]
    shapes = [(p.group, len(p.record.positions), len(p.record.slot_contexts())) for p in stored]
    now = measure_calls(model, name, stored[0].spec, profile.device, shapes)
    ratios = [n.measured_s / s.measured_s for n, s in zip(now, stored, strict=True)]
    return abs(np.log(statistics.median(ratios))) <= np.log1p(TOLERANCE)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def profile_for(model, name: str, device: str, say=print) -> tuple[str, CalibrationProfile]:
    """(where it came from, the profile) that prices ``model`` on this machine for
    ``--schedule auto``: a committed calibration of this machine; else the one made here before
    (reused while its calls still run near their stored times, checked at most once an hour);
    else a committed profile of this device kind transplanted here (about a second), and kept
    in ``cache_dir()``. ``say`` hears what it did, in a line."""
    from costmodel.profile import ProfileError, load_profile, save_profile
    from costmodel.store import cache_dir, committed_profiles

    from .checkpoint import DTYPE_NAMES
    from .options import GenerationError
    from .runtime import machine_name

    family, machine = model.config.family, machine_name(device)
    dtype = DTYPE_NAMES[next(model.parameters()).dtype]
    # a profile prices its own dtype (its peaks, a CPU's product curve): only that one serves
    committed = [(path, p) for path, p in committed_profiles(family, device) if p.dtype == dtype]
    here = [(path, profile) for path, profile in committed if profile.machine == machine]
    if here:
        return str(here[0][0]), here[0][1]
    cached = cache_dir() / "profiles" / f"{_slug(machine)}-{_slug(name)}-{dtype}.json"
    if cached.is_file():
        try:
            profile = load_profile(cached)
        except ProfileError:
            profile = None
        fresh = profile is not None and time.time() - cached.stat().st_mtime < RECHECK_S
        if profile is not None and (fresh or still_holds(profile, model, name)):
            if not fresh:
                cached.touch()  # checked: good for another hour
            return str(cached), profile
        say(f"auto: the profile kept for this machine ({cached}) no longer prices it; "
            "timing it again")
    if not committed:
        on = "" if device == "cpu" else f" --device {device}"
        raise GenerationError(f"no calibration profile of {family} in {dtype} on a {device} to "
                              f"start from; make one with `costmodel calibrate --model {family}"
                              f"{on} --dtype {dtype}`")
    base = committed[0][1]
    say(f"auto: no calibration of this machine ({machine}); timing {len(SHAPES)} calls of "
        f"{name} to rescale {base.machine}'s profile")
    profile = transplant(base, model, name, machine)
    try:
        save_profile(profile, cached)
    except OSError as exc:
        say(f"auto: cannot keep this machine's profile in {cached.parent} ({exc.strerror}); it "
            "is timed again next time")
        return "this machine's calls, timed just now", profile
    return str(cached), profile
