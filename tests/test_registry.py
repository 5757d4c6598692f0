"""A new schedule is one module and one registration (costmodel.schedules): registered, a toy
schedule is priced by predict and recommend, simulated, decoded by wfd's generate, batch and
command line, and its tokens are AR's."""

from typing import Literal

import pytest
from conftest import model_for
from typer.testing import CliRunner

from costmodel import get_hardware, get_model, predict, recommend, simulate
from costmodel.schedules import SCHEDULES, Drafting, DtV, get, register
from costmodel.schedules.dtv import DtVPlan


class Pair(Drafting):
    """A toy: draft one token at depth d, verify it with the next position's draft (DtV at
    k = 1, as a schedule of its own)."""

    title = "Pair"
    kind: Literal["pair"] = "pair"

    def as_dtv(self) -> DtV:
        return DtV(draft_depth=self.draft_depth, block_length=1)

    def plan(self, prompt_length, depth, *, coda_attends, readout_depths=(), prefill=True,
             exits=None, drafts=None):
        return DtVPlan(prompt_length, depth, block_length=1, draft_depth=self.draft_depth,
                       coda_attends=coda_attends, prefill=prefill, exits=exits, drafts=drafts)

    def lookahead(self, depth):
        return 2

    def positions_per_call(self, depth):
        return 2

    def call_groups(self, depth, kv_sharing=0):
        return self.as_dtv().call_groups(depth, kv_sharing)

    @classmethod
    def variants(cls, draft_depth, depth, *, block_length=None, width_cap=None, quick=False):
        return [cls(draft_depth=draft_depth)]

    def fields(self, depth):
        return {"draft_depth": self.draft_depth, "width": 2, "block_length": 1}

    @classmethod
    def label(cls, draft_depth=None, block_length=None, width=None, width_cap=None):
        return f"Pair d={draft_depth}"

    @classmethod
    def of(cls, draft_depth=None, block_length=None, width_cap=None):
        return cls(draft_depth=draft_depth)

    def run_stats(self, plan, verifier_stats):
        return {**verifier_stats, "rounds": plan.rounds, "draft_depth": self.draft_depth}

    def batch_stats(self, plan):
        return {"draft_depth": self.draft_depth}


@pytest.fixture
def pair():
    register(Pair)  # what a schedule's module does with @register
    yield Pair
    del SCHEDULES["pair"]


def test_a_registered_schedule_is_priced_searched_and_simulated(pair):
    assert get("pair") is Pair
    p = predict("huginn-3.5b", "a6000", {"context_length": 512}, draft_depth=4)
    assert list(p.schedules) == ["ar", "dtv", "wfd", "pair"]
    mine = p.schedules["pair"]
    # DtV at k = 1 by another name: the same price, its own label and fields
    k1 = predict("huginn-3.5b", "a6000", {"context_length": 512}, draft_depth=4,
                 block_length=1).schedules["dtv"]
    assert mine.latency_per_token_s == pytest.approx(k1.latency_per_token_s)
    assert (mine.block_length, mine.width, mine.acceptance) == (1, 2, k1.acceptance)
    choices = recommend("huginn-3.5b", "a6000", {4: 0.5}, top=40)
    assert any(c.schedule == "pair" and c.label == "Pair d=4" for c in choices)
    assert next(c for c in choices if c.schedule == "pair").flags == \
        "--schedule pair --draft-depth 4"
    sim = simulate(get_model("huginn-3.5b"), get_hardware("a6000"), Pair(draft_depth=4),
                   context_length=64, new_tokens=20, acceptance=0.8)
    ref = simulate(get_model("huginn-3.5b"), get_hardware("a6000"), Pair(draft_depth=4)
                   .as_dtv(), context_length=64, new_tokens=20, acceptance=0.8)
    assert sim.latency_s == pytest.approx(ref.latency_s)


def test_a_registered_schedule_decodes_as_ar_does(pair):
    from wfd.batch import Request, decode_batch
    from wfd.generate import generate

    model = model_for("huginn", easy=True)
    prompt = [3, 1, 4, 1, 5]
    ar = generate(model, prompt, schedule="ar", max_new_tokens=12).tokens
    run = generate(model, prompt, schedule="pair", max_new_tokens=12, draft_depth=2)
    assert run.tokens == ar and run.schedule == "pair"
    assert run.stats["draft_depth"] == 2 and run.stats["rounds"] >= 6
    batch = decode_batch(model, [Request(0, prompt, 12), Request(1, prompt[:3], 12)],
                         schedule="pair", batch_size=2, draft_depth=2)
    assert batch.results[0].tokens == ar and batch.stats["schedule"] == "pair"


def test_the_command_line_offers_a_registered_schedule(pair):
    from wfd.cli import app

    out = CliRunner().invoke(app, ["generate", "--model", "huginn-tiny", "--prompt-ids",
                                   "1,2,3", "--schedule", "pair", "--max-new-tokens", "6",
                                   "--json"])
    assert out.exit_code == 0, out.output
    assert '"schedule": "pair"' in out.output
