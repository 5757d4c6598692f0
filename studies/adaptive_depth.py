"""adaptive-depth: WFD's and DtV's speedup over AR with the same exits, and the tokens/s of all
three, as the mean exit depth falls from R to R/4 (the WFD paper's open question: does a
shallower average depth narrow the wavefront and shrink WFD's lead, even as every schedule gets
faster?).

Huginn-3.5B and Ouro-2.6B on two GPU presets in CUDA graphs mode and this project's CPU
calibration of each family.
Exit depths take three shapes, each scaled to the mean: a point (every token at the mean,
split between the two depths around it), a spread (uniform over a range ending at R or starting
at 1), and the shape the shipped tiny model of the family measured with its rule on held-out
text (wfd/models/NAME/measurements.json; depths as fractions of R, scaled). Drafts of tokens
that go past the draft depth are accepted at the model's default acceptance. Context 512 + 512
new tokens (Huginn-3.5B in fp32 with a coda slot per exit depth fits the CPU's memory).
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel import get_hardware, predict
from costmodel.hardware import HardwareSpec
from costmodel.store import PROFILES_DIR

from .common import StudyResult, workload

MODELS = {"huginn-3.5b": ("huginn", "huginn-tiny"), "ouro-2.6b": ("ouro", "ouro-tiny")}
GPUS = ["a6000", "h200"]
FRACTIONS = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)
CONTEXT = 512
ROOT = Path(__file__).resolve().parent.parent
# the rule each tiny model's measured shape is read under (its card says why)
MEASURED_RULE = {"huginn-tiny": "kl:0.001", "ouro-tiny": "gate:0.9"}


def point(mean: float, depth: int) -> dict[int, float]:
    low = int(mean)
    if low >= depth:
        return {depth: 1.0}
    high = mean - low
    return {r: p for r, p in ((low, 1 - high), (low + 1, high)) if p > 0}


def spread(mean: float, depth: int) -> dict[int, float]:
    """Uniform over the widest range of whole depths in 1..R centred on the mean (a mean half
    way between two depths spreads over an even count)."""
    half = min(mean - 1, depth - mean)
    first, last = round(mean - half), round(mean + half)
    dist = {r: 1.0 for r in range(first, last + 1)}
    total = sum(dist.values())
    return {r: w / total for r, w in dist.items()}


def scaled(fractions: dict[float, float], mean: float, depth: int) -> dict[int, float]:
    """A measured shape (exit depth as a fraction of R: probability) stretched to ``mean``:
    depths scaled by one factor, rounded and kept in 1..R, the factor found by bisection."""
    def place(factor: float) -> dict[int, float]:
        out: dict[int, float] = {}
        for u, p in fractions.items():
            r = min(depth, max(1, round(u * depth * factor)))
            out[r] = out.get(r, 0.0) + p
        return out

    low, high = 0.0, 8.0
    for _ in range(60):
        mid = (low + high) / 2
        got = sum(r * p for r, p in place(mid).items())
        low, high = (mid, high) if got < mean else (low, mid)
    return place((low + high) / 2)


def measured_shape(tiny: str) -> dict[float, float] | None:
    path = ROOT / "wfd" / "models" / tiny / "measurements.json"
    exits = json.loads(path.read_text()).get("exits", {}) if path.is_file() else {}
    record = exits.get(MEASURED_RULE[tiny])
    if record is None:
        return None
    depth = record["depth"]
    return {int(r) / depth: p for r, p in record["exit_depths"].items()}


def cpu_hardware(family: str) -> HardwareSpec:
    """The committed CPU calibration of ``family`` (package data: always there)."""
    from costmodel.profile import load_profile

    return load_profile(PROFILES_DIR / f"cpu-{family}-fp32.json").hardware


def draw(fig, rows: list[dict]) -> None:
    """Per model and device, WFD's and DtV's speedup (top) and WFD's and AR's tokens/s
    (bottom) against the mean exit depth, a colour per shape."""
    keys = list(dict.fromkeys((r["model"], r["hardware"]) for r in rows))
    axes = fig.subplots(2, len(keys), squeeze=False)
    for col, (model, hw) in enumerate(keys):
        top, bottom = axes[0][col], axes[1][col]
        labels = list(dict.fromkeys(r["shape"] for r in rows if r["model"] == model))
        for i, label in enumerate(labels):
            mine = [r for r in rows if (r["model"], r["hardware"], r["shape"]) ==
                    (model, hw, label)]
            x = [r["mean_exit_depth"] for r in mine]
            top.plot(x, [r["wfd_speedup"] for r in mine], marker="o", markersize=3,
                     color=f"C{i}", label=f"WFD, {label}")
            top.plot(x, [r["dtv_speedup"] for r in mine], linestyle=":", color=f"C{i}")
            bottom.plot(x, [r["wfd_tokens_per_s"] for r in mine], marker="o",
                        markersize=3, color=f"C{i}")
            bottom.plot(x, [r["ar_tokens_per_s"] for r in mine], linestyle="--",
                        color=f"C{i}")
        top.set_title(f"{model}\n{hw}", fontsize=7)
        top.invert_xaxis()
        bottom.invert_xaxis()
        bottom.set_xlabel("mean exit depth", fontsize=8)
    axes[0][0].set_ylabel("speedup over AR-with-exit\n(WFD solid, DtV dotted)", fontsize=8)
    axes[1][0].set_ylabel("tokens/s\n(WFD solid, AR dashed)", fontsize=8)
    axes[0][0].legend(fontsize=6)


def run(profile: HardwareSpec | None = None, small: bool = False) -> StudyResult:
    # small (the tests'): two depths, no spread shape; each WFD point is simulated call by call
    fractions = (1.0, 0.25) if small else FRACTIONS
    rows = []
    for model, (family, tiny) in MODELS.items():
        depth = {"huginn": 32, "ouro": 4}[family]
        # the GPUs in graphs mode: the device's work decides the answer, not an eager host's
        hardware = [get_hardware(g).in_mode("graphs").model_copy(update={"name": f"{g} graphs"})
                    for g in GPUS[:1 if small else 2]]
        hardware.append(profile if profile is not None else cpu_hardware(family))
        shapes = {"point": point} if small else {"point": point, "spread": spread}
        measured = measured_shape(tiny)
        if measured is not None:
            shapes[f"{tiny} {MEASURED_RULE[tiny]}"] = lambda m, r, f=measured: scaled(f, m, r)
        for hw in hardware:
            name = hw.name
            for label, shape in shapes.items():
                seen = []
                for fraction in fractions:
                    dist = shape(fraction * depth, depth)
                    if dist in seen:  # a coarse shape (few depths) that lands on one already
                        continue
                    seen.append(dist)
                    s = predict(model, hw, workload(hw, context_length=CONTEXT,
                                                    exit_depths=dist)).schedules
                    rows.append({
                        "model": model, "hardware": name, "shape": label,
                        "mean_exit_depth": s["ar"].mean_exit_depth,
                        "ar_tokens_per_s": s["ar"].tokens_per_s,
                        "dtv_tokens_per_s": s["dtv"].tokens_per_s,
                        "wfd_tokens_per_s": s["wfd"].tokens_per_s,
                        "dtv_speedup": s["dtv"].speedup_vs_ar,
                        "wfd_speedup": s["wfd"].speedup_vs_ar,
                        "wfd_block_calls_per_token": s["wfd"].block_calls_per_token})

    return StudyResult("adaptive-depth", "Speedup over AR with the same exits, as the mean exit "
                       "depth falls", rows, lambda fig: draw(fig, rows))
