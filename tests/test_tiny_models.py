"""The shipped tiny trained models load, decode, and draft for real."""

import json
import subprocess
import sys

import pytest

from wfd.checkpoint import SHIPPED_DIR, load_model, shipped_models
from wfd.generate import generate

PROMPT = list(b"    def __init__(self, name, value=None):\n        self.")


def test_both_models_ship_small_with_a_card():
    assert {"huginn-tiny", "ouro-tiny"} <= set(shipped_models())
    for name in ("huginn-tiny", "ouro-tiny"):
        folder = SHIPPED_DIR / name
        assert (folder / "model.safetensors").stat().st_size < 20e6
        card = (folder / "README.md").read_text()
        assert "bits per byte" in card and "agreement" in card


@pytest.mark.parametrize(("name", "depth", "d"), [("huginn-tiny", 8, 2), ("ouro-tiny", 4, 1)])
def test_wfd_and_dtv_equal_ar_with_real_drafts(name, depth, d):
    model = load_model(name)
    assert model.config.depth == depth
    ar = generate(model, PROMPT, schedule="ar", max_new_tokens=40, record=False)
    wfd = generate(model, PROMPT, schedule="wfd", max_new_tokens=40, draft_depth=d,
                   record=False)
    dtv = generate(model, PROMPT, schedule="dtv", max_new_tokens=40, draft_depth=d,
                   block_length=4, record=False)
    assert wfd.tokens == ar.tokens == dtv.tokens
    assert wfd.stats["accepted"] > 0
    text = bytes(ar.tokens).decode("utf-8", errors="replace")
    assert text.isprintable() or "\n" in text  # source code, not noise


def test_generate_defaults_to_huginn_tiny():
    out = subprocess.run([sys.executable, "-m", "wfd", "generate", "--prompt", "import os\n",
                          "--schedule", "wfd", "--max-new-tokens", "24", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["new_tokens"] == 24 and payload["schedule"] == "wfd"
    assert 0 < payload["acceptance"] <= 1 and isinstance(payload["text"], str)


def test_the_source_corpus_leaves_out_the_test_suites():
    from wfd.train import corpus_files, trained_corpus

    everything, source = corpus_files("stdlib"), corpus_files("stdlib-src")
    assert corpus_files("stdlib-code") == source  # the same files, less their prose
    assert set(source) < set(everything)
    assert not any(p.name.startswith("test_") or "test" in p.parts for p in source)
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus_files("web")
    assert trained_corpus(SHIPPED_DIR / "huginn-tiny") == "stdlib-code"
    assert trained_corpus(SHIPPED_DIR / "ouro-tiny") == "stdlib"  # trained before the option


def test_the_code_corpus_drops_docstrings_and_comments_and_still_parses():
    import ast

    from wfd.train import code_only

    source = (b'"""Module doc."""\n# a comment line\nimport os  # trailing\n\n\n\n\n'
              b'def f(x):\n    """Only a docstring,\n    on two lines."""\n\n'
              b'class C:\n    """Doc."""\n    s = "# not a comment"\n\n'
              b'def g(): "kept: it shares its line"\n')
    code = code_only(source).decode()
    assert "doc" not in code.lower().replace("# not a comment", "") and "comment line" not in code
    assert "import os\n" in code and "trailing" not in code
    assert "def f(x):\n    pass\n" in code  # a body that was only a docstring stays a body
    assert 's = "# not a comment"' in code and '"kept: it shares its line"' in code
    assert "\n\n\n\n" not in code
    ast.parse(code)
    assert code_only(b"def broken(:\n") is None
