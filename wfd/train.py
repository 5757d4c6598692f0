"""Train the tiny looped models shipped in wfd/models/ (not run in CI).

    python -m wfd.train --family huginn --minutes 50 --out wfd/models/huginn-tiny
    python -m wfd.train --family ouro --minutes 50 --out wfd/models/ouro-tiny

Corpus (``--corpus``): the .py sources of the running interpreter's standard library
(``stdlib``), or the same without its test suites (``stdlib-src``: about 40% of the bytes,
none of the repeated assertion lines that make up much of the tests), or that without its
docstrings and comments (``stdlib-code``: code only, so that a model prompted with a ``def``
writes statements rather than prose), split by file into train
(about 95%) and held-out sets by a hash of the file's path (deterministic). Byte-level
vocabulary (256). Architectures: the `huginn-tiny` and `ouro-tiny` presets of costmodel.

- Ouro: the whole stack looped R = 4 times; cross-entropy at every loop exit, averaged. Then,
  with ``--gate-only`` (the language model frozen, as the Ouro recipe's last stage), its exit
  gate: at each step t < R it is taught to exit where the next step would not improve the
  token's loss, towards 1 - sigmoid(50 (I_t - 0.005)) with I_t = loss_t - loss_{t+1}.

    python -m wfd.train --family ouro --out wfd/models/ouro-tiny --gate-only --minutes 5
- Huginn: a random depth per step, drawn as Huginn was trained (Poisson of a log-normal rate,
  here with mean ``--mean-depth``, optionally ramped up from 1 over the first ``--depth-ramp``
  of the time budget), truncated backpropagation through the last
  ``--backprop-depth`` steps, and the loss at the final depth plus, with weight
  ``--intermediate-weight``, at the readouts of the steps inside the backprop window (so that
  shallow depths are supervised as drafts while deep ones keep improving).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import sysconfig
import time
import tokenize
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from costmodel.presets import MODELS

from .checkpoint import build, init_random, save
from .config import ModelConfig
from .layers import CallPlan

CORPORA = ("stdlib", "stdlib-src", "stdlib-code")


def is_test_file(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return "test" in parts or "tests" in parts or path.name.startswith("test_")


def corpus_files(corpus: str = "stdlib") -> list[Path]:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: choose one of {', '.join(CORPORA)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts
                  and not (corpus != "stdlib" and is_test_file(p, root)))


def code_only(source: bytes) -> bytes | None:
    """``source`` without its docstrings and comments (a docstring that is its body's only
    statement becomes ``pass``, so the code still parses), or None for a file that does not
    parse under this interpreter (the test suites hold deliberately broken ones; Python 3.11.7's
    sources outside them all parse)."""
    try:
        text = source.decode("utf-8")
        tree = ast.parse(text)
        comments = [tok.start for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return None
    lines = text.splitlines()
    drop: set[int] = set()  # 0-based line numbers
    replace: dict[int, str] = {}
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        doc = body[0] if isinstance(body, list) and body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            continue
        first, last = doc.lineno - 1, doc.end_lineno - 1
        if lines[first][:doc.col_offset].strip() or lines[last][doc.end_col_offset:].strip():
            continue  # shares a line with code (``def f(): "doc"``): leave it
        drop.update(range(first, last + 1))
        if len(body) == 1:
            replace[first] = lines[first][:doc.col_offset] + "pass"
    for row, col in comments:
        row -= 1
        if row in drop:
            continue
        kept = lines[row][:col].rstrip()
        if kept:
            lines[row] = kept
        else:
            drop.add(row)
    out, blank = [], 0
    for number, line in enumerate(lines):
        if number in replace:
            line = replace[number]
        elif number in drop:
            continue
        blank = blank + 1 if not line.strip() else 0
        if blank <= 2:
            out.append(line)
    return ("\n".join(out) + "\n").encode()


def is_held_out(path: Path, root: Path) -> bool:
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return digest[0] < 13  # about 5% of files


def load_corpus(split: str, corpus: str = "stdlib") -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for path in corpus_files(corpus):
        if is_held_out(path, root) == (split == "heldout"):
            try:
                source = path.read_bytes()
            except OSError:
                continue
            if corpus == "stdlib-code":
                source = code_only(source)
            if source:
                chunks.append(source)
    return b"\n\n".join(chunks)


def trained_corpus(folder: Path) -> str:
    """The corpus a model folder's ``training.json`` says it was trained on (models trained
    before ``--corpus`` existed used the whole standard library)."""
    record = folder / "training.json"
    return json.loads(record.read_text()).get("corpus", "stdlib") if record.exists() else "stdlib"


def batches(data: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


def sample_depth(mean: float, cap: int, gen: torch.Generator) -> int:
    """1 + Poisson(rate), rate ~ LogNormal with mean ``mean - 1`` (Huginn's sampler)."""
    sigma = 0.5
    mu = math.log(max(mean - 1, 1e-3)) - sigma**2 / 2
    rate = math.exp(mu + sigma * float(torch.randn((), generator=gen)))
    return int(min(cap, 1 + torch.poisson(torch.tensor(rate), generator=gen).item()))


def ramped_mean_depth(mean: float, ramp: float, elapsed_fraction: float) -> float:
    """The mean depth at a point of the run: from 1 up to ``mean`` linearly over the first
    ``ramp`` of the time budget, then ``mean`` (a curriculum over depth, as in work that
    retrofits recurrence: early steps, which learn byte statistics that need no depth, cost a
    few iterations instead of ``mean``, so the same minutes see more data). On huginn-tiny it
    bought 22% more steps and a model that answers at depth 1 (docs/tiny-models.md)."""
    if ramp <= 0 or elapsed_fraction >= ramp:
        return mean
    return 1 + (mean - 1) * elapsed_fraction / ramp


def forward_losses(model, x, y, depth: int, backprop: int, gen: torch.Generator,
                   family: str, intermediate: bool = True) -> list[torch.Tensor]:
    """Cross-entropy at the readouts that carry gradient, last one = the final depth; without
    ``intermediate``, at the final depth only (a readout weighted zero would still cost its coda
    forward and backward, for nothing)."""
    positions = list(range(x.shape[1]))
    plan = CallPlan.uncached(positions, model.config, x.device)
    e = model.prelude(x, plan, None)
    state = e
    if family == "huginn":  # a fresh random initial state, as in training the release
        std = model.state_std
        state = torch.empty_like(e)
        torch.nn.init.trunc_normal_(state, 0.0, std, -3 * std, 3 * std, generator=gen)
        state = state * model.embed_scale
    losses = []
    no_grad_steps = max(depth - backprop, 0)
    with torch.no_grad():
        for _ in range(no_grad_steps):
            state = model.block(state, e, plan, None)
    if no_grad_steps:
        state = state.detach()
    for step in range(no_grad_steps, depth):
        state = model.block(state, e, plan, None)
        if not intermediate and step < depth - 1:
            continue
        logits = model.coda(state, plan, None)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return losses


@torch.no_grad()
def evaluate(model, data: torch.Tensor, depth: int, length: int = 256, windows: int = 16,
             max_depth: int | None = None) -> dict[str, list[float]]:
    """Held-out bits per byte at each depth 1..max_depth (default R = ``depth``), and the greedy
    agreement of each depth with depth R."""
    max_depth = max(max_depth or depth, depth)
    model.eval()
    step = max((data.numel() - length - 1) // windows, 1)
    nll = torch.zeros(max_depth)
    agree = torch.zeros(max_depth)
    count = 0
    for w in range(windows):
        chunk = data[w * step: w * step + length + 1]
        x, y = chunk[:-1][None], chunk[1:]
        positions = list(range(length))
        plan = CallPlan.uncached(positions, model.config, x.device)
        e = model.prelude(x, plan, None)
        # Huginn's (seed, position) state is one row per position
        state = model.initial_state(positions, e[0]).expand_as(e)
        preds = []
        for r in range(1, max_depth + 1):
            state = model.block(state, e, plan, None)
            logits = model.coda(state, plan, None)[0]
            nll[r - 1] += F.cross_entropy(logits, y, reduction="sum")
            preds.append(logits.argmax(-1))
        for r in range(max_depth):
            agree[r] += (preds[r] == preds[depth - 1]).sum()
        count += length
    model.train()
    return {"bits_per_byte": (nll / count / math.log(2)).tolist(),
            "agreement_with_full_depth": (agree / count).tolist()}


GATE_SHARPNESS, GATE_MIN_GAIN = 50.0, 0.005  # the Ouro recipe's gate labels


def gate_targets(losses: torch.Tensor) -> torch.Tensor:
    """Exit targets for steps 1..R-1 from per-token losses at every step [R, ...]: exit where
    the next step does not improve the loss by more than GATE_MIN_GAIN nats."""
    gain = losses[:-1] - losses[1:]
    return 1.0 - torch.sigmoid(GATE_SHARPNESS * (gain - GATE_MIN_GAIN))


def gate_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the exit gate's hazards against ``gate_targets``; the language
    model runs without gradients."""
    depth = model.config.depth
    positions = list(range(x.shape[1]))
    plan = CallPlan.uncached(positions, model.config, x.device)
    with torch.no_grad():
        e = model.prelude(x, plan, None)
        state = model.initial_state(positions, e[0]).expand_as(e)
        states, losses = [], []
        for _ in range(depth):
            state = model.block(state, e, plan, None)
            logits = model.coda(state, plan, None)
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none"))
            states.append(state)
        targets = gate_targets(torch.stack(losses))
    hazards = torch.stack([model.exit_lambda(s).flatten() for s in states[:-1]])
    return F.binary_cross_entropy(hazards.clamp(1e-6, 1 - 1e-6), targets)


def train_gate(args, train: torch.Tensor, gen: torch.Generator) -> tuple[object, int, list]:
    """The ``--gate-only`` stage: the model in ``--out`` with only its exit gate trained."""
    from .checkpoint import load_model

    model = load_model(str(args.out))
    for p in model.parameters():
        p.requires_grad_(False)
    gate = model.model.early_exit_gate
    for p in gate.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(gate.parameters(), lr=args.lr, weight_decay=0.0)
    steps, log = optimise(opt, train, args, gen,
                          lambda x, y, step, frac: (gate_loss(model, x, y), {}))
    return model, steps, log


def optimise(opt: torch.optim.Optimizer, train: torch.Tensor, args, gen: torch.Generator,
             step_loss: Callable[[torch.Tensor, torch.Tensor, int, float],
                                 tuple[torch.Tensor, dict]],
             clip_model: torch.nn.Module | None = None) -> tuple[int, list]:
    """Steps ``opt`` on random windows of ``train`` until ``args.minutes`` have passed;
    ``step_loss(x, y, steps so far, elapsed fraction of the budget)`` gives a step's loss and the
    fields it adds to the log line printed every 50 steps. With ``clip_model``, that model's
    gradients are clipped to norm 1 before each step. Returns the steps taken and the log."""
    budget = args.minutes * 60
    start, step, log = time.time(), 0, []
    for x, y in batches(train, args.batch, args.length, gen):
        elapsed = time.time() - start
        if elapsed > budget:
            break
        loss, fields = step_loss(x, y, step, elapsed / budget)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip_model is not None:
            torch.nn.utils.clip_grad_norm_(clip_model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            line = {"step": step, "minutes": round(elapsed / 60, 1), "loss": round(loss.item(), 4),
                    **fields}
            log.append(line)
            print(json.dumps(line), flush=True)
    return step, log


def parse_arguments() -> argparse.Namespace:
    """The command line, with the numbers training cannot use refused (exit status 2)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("huginn", "ouro"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", choices=CORPORA, default="stdlib")
    parser.add_argument("--minutes", type=float, default=50.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mean-depth", type=float, default=12.0)
    parser.add_argument("--depth-ramp", type=float, default=0.0,
                        help="fraction of the time budget over which the mean depth rises "
                             "linearly from 1 to --mean-depth (0: no ramp)")
    parser.add_argument("--max-depth", type=int, default=32)
    parser.add_argument("--backprop-depth", type=int, default=4)
    parser.add_argument("--intermediate-weight", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate-only", action="store_true",
                        help="Ouro: train only the exit gate of the model already in --out")
    args = parser.parse_args()
    for name in ("minutes", "batch", "length", "lr", "mean_depth", "max_depth", "backprop_depth",
                 "threads"):  # each ran into a traceback, a NaN loss or a loop that never ended
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if not args.intermediate_weight >= 0:
        parser.error(f"--intermediate-weight must be >= 0, not {args.intermediate_weight}")
    if not 0 <= args.depth_ramp <= 1:
        parser.error(f"--depth-ramp is a fraction of the minutes, 0 to 1, not {args.depth_ramp}")

    if args.gate_only and args.family != "ouro":
        parser.error("--gate-only trains an Ouro model's exit gate")
    return args


def pretraining_loss(model, opt: torch.optim.Optimizer, args, gen: torch.Generator,
                     x: torch.Tensor, y: torch.Tensor, step: int,
                     frac: float) -> tuple[torch.Tensor, dict]:
    """One step of training the language model: sets the step's learning rate, and returns the
    loss of the family's recipe (module docstring) and the rate, for the log."""
    # cosine decay over the time budget, after a short warm-up
    lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))
    for group in opt.param_groups:
        group["lr"] = lr
    if args.family == "ouro":
        depth = model.config.depth
        losses = forward_losses(model, x, y, depth, depth, gen, "ouro")
        loss = sum(losses) / len(losses)
    else:
        mean_depth = ramped_mean_depth(args.mean_depth, args.depth_ramp, frac)
        depth = sample_depth(mean_depth, args.max_depth, gen)
        losses = forward_losses(model, x, y, depth, args.backprop_depth, gen, "huginn",
                                intermediate=args.intermediate_weight != 0)
        loss = losses[-1]
        if len(losses) > 1:
            loss = loss + args.intermediate_weight * sum(losses[:-1]) / (len(losses) - 1)
    return loss, {"lr": lr}


def write_training_record(args, start: float, steps: int, log: list, train: torch.Tensor,
                          heldout: torch.Tensor, metrics: dict) -> None:
    """``training.json`` in ``--out``: how the model was trained and how it scored held out."""
    (args.out / "training.json").write_text(json.dumps({
        "command": "python -m wfd.train " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "corpus": args.corpus, "steps": steps, "minutes": round((time.time() - start) / 60, 1),
        "train_bytes": train.numel(), "heldout_bytes": heldout.numel(),
        "torch": torch.__version__, "heldout": metrics, "log": log,
    }, indent=2) + "\n")


def main() -> None:
    args = parse_arguments()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if args.gate_only:
        return _gate_only(args, gen)
    cfg = ModelConfig.from_spec(MODELS[f"{args.family}-tiny"])
    model = init_random(build(cfg), seed=args.seed)
    model.train()
    train, heldout = (torch.frombuffer(bytearray(load_corpus(split, args.corpus)),
                                       dtype=torch.uint8).long() for split in ("train", "heldout"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    start = time.time()
    steps, log = optimise(
        opt, train, args, gen,
        lambda x, y, step, frac: pretraining_loss(model, opt, args, gen, x, y, step, frac),
        clip_model=model)
    model.eval()
    metrics = evaluate(model, heldout, cfg.depth,
                       max_depth=args.max_depth if args.family == "huginn" else None)
    save(model, args.out)
    write_training_record(args, start, steps, log, train, heldout, metrics)
    print(json.dumps(metrics))


def _gate_only(args, gen: torch.Generator) -> None:
    record = json.loads((args.out / "training.json").read_text())
    train = torch.frombuffer(bytearray(load_corpus("train", trained_corpus(args.out))),
                             dtype=torch.uint8).long()
    start = time.time()
    model, steps, log = train_gate(args, train, gen)
    model.eval()
    config = (args.out / "config.json").read_text()
    save(model, args.out)
    (args.out / "config.json").write_text(config)  # the weights changed, the config did not
    record["gate"] = {
        "command": f"python -m wfd.train --family ouro --out {args.out} --gate-only "
                   f"--minutes {args.minutes} --batch {args.batch} --length {args.length} "
                   f"--lr {args.lr} --threads {args.threads} --seed {args.seed}",
        "labels": f"exit where the next step gains at most {GATE_MIN_GAIN} nats "
                  f"(sharpness {GATE_SHARPNESS:g})",
        "steps": steps, "minutes": round((time.time() - start) / 60, 1), "log": log}
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
