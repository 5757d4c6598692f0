"""The shape of the code: no import cycle among the project's modules, a cost model that imports
no heavy package, and a clear error when a command needs an extra that is not installed."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("costmodel", "wfd", "calibrate", "studies")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules ``name`` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                break
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    files = module_files()
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    assert "wfd.runtime" in graph["wfd.generate"]  # the parser sees relative imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cost_model_imports_no_other_package_of_the_project():
    """costmodel is the bottom layer: the decoder, calibration and studies build on it, and its
    command line finds their commands through entry points, not imports (lazy ones included)."""
    files = module_files()
    upward = {f"{name} -> {target}" for name, path in files.items() if name.startswith("costmodel")
              for target in imports_of(name, path, set(files))
              if not target.startswith("costmodel")}
    assert upward == set()
    assert "calibrate.run" in imports_of("calibrate.cli", files["calibrate.cli"], set(files))


def test_the_decoder_imports_neither_calibration_nor_studies():
    """wfd (the decoder and its vLLM plugin) builds on costmodel only: calibration measures the
    decoder and the studies read the cost model, not the other way round (lazy imports
    included)."""
    files = module_files()
    upward = {f"{name} -> {target}" for name, path in files.items() if name.startswith("wfd")
              for target in imports_of(name, path, set(files))
              if target.startswith(("calibrate", "studies"))}
    assert upward == set()
    assert "wfd.timing" in imports_of("calibrate.run", files["calibrate.run"], set(files))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


HEAVY = ("torch", "scipy", "matplotlib")


def test_the_cost_model_imports_no_heavy_package():
    code = f"""
import sys
sys.argv = ["costmodel", "predict", "--bandwidth", "768GB/s", "--width", "8", "--json"]
import costmodel, costmodel.plans, costmodel.simulate, costmodel.trace, costmodel.profile
import studies
from costmodel.cli import main
try:
    main()
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)
"""
    out = _python("import json\n" + code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["schedules"]["wfd"]["width"] == 8
    assert json.loads(out.stderr.strip().splitlines()[-1]) == []


def test_a_checkpoint_loads_without_torch_s_compiler():
    """A model made on the meta device for a checkpoint's weights draws no initial weights: the
    first draw there imported torch._dynamo, 2 s of every `wfd` command's start."""
    code = """
import sys
from wfd.checkpoint import load_model
model = load_model("huginn-tiny")
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


BLOCK = "import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"


def test_a_command_needing_a_missing_extra_says_which(tmp_path):
    wfd = BLOCK.format(blocked=["torch"]) + "from wfd.cli import main\nmain()"
    out = _python(wfd, "generate", "--prompt", "hi")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: this command needs torch, which is not installed: "
        "pip install 'looped-decoding[decoder]'"]
    # a study without matplotlib still writes its tables, and says why there is no figure
    study = BLOCK.format(blocked=["matplotlib"]) + "from costmodel.cli import main\nmain()"
    out = _python(study, "study", "memory", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "memory.csv").is_file() and not (tmp_path / "memory.png").exists()
    assert "looped-decoding[plots]" in out.stderr


def test_every_bench_script_imports_and_parses_its_arguments(monkeypatch, capsys):
    # the benches import each other's helpers; a renamed helper must fail here, not on a GPU.
    # Run as __main__ in this process (torch is imported once, not once per script).
    import runpy

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    for script in sorted(bench.glob("*.py")):
        if "__main__" not in script.read_text():  # a helper the scripts share: it imports
            runpy.run_path(str(script), run_name=script.stem)
            continue
        monkeypatch.setattr(sys, "argv", [str(script), "--help"])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        assert done.value.code in (0, None), script.name
        assert "usage:" in capsys.readouterr().out, script.name


def test_a_bench_script_s_bad_input_is_one_line(monkeypatch, capsys):
    # an unknown model or preset gave a traceback
    import runpy

    bench = Path(__file__).resolve().parents[1] / "bench"
    for script, args in (("graph_shapes.py", ["--models", "gpt-5"]),
                         ("decode_speed.py", ["schedules", "--models", "gpt-5"])):
        monkeypatch.setattr(sys, "argv", [script, *args])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(bench / script), run_name="__main__")
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and len(err) == 1 and "gpt-5" in err[0], err


def test_a_package_name_stays_the_function_once_its_module_is_imported():
    """`wfd.generate` and `costmodel.predict` are functions defined in modules of the same
    name; importing those modules (as loading a model does) must not put the module in the
    function's place."""
    code = """
import costmodel, wfd
model = wfd.load_model("ouro-tiny")
import wfd.batch, wfd.checkpoint, costmodel.simulate
from costmodel import predict
assert callable(wfd.generate) and callable(wfd.decode_batch) and callable(costmodel.simulate)
assert callable(costmodel.predict) and callable(costmodel.recommend)
assert len(wfd.generate(model, [1, 2, 3], max_new_tokens=2).tokens) == 2
try:
    wfd.nothing
except AttributeError as exc:
    print(exc)
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'wfd' has no attribute 'nothing'"


def test_the_committed_profiles_ship_inside_the_cost_model_package():
    """Profiles are package data (a wheel carries them), found without torch."""
    import tomllib

    from costmodel.store import PROFILES_DIR, committed_profiles

    root = Path(__file__).resolve().parents[1]
    assert PROFILES_DIR.is_relative_to(root / "costmodel")
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["costmodel"]
    shipped = {p for pattern in patterns for p in (root / "costmodel").glob(pattern)}
    found = [path for family in ("huginn", "ouro") for device in ("cpu", "cuda")
             for path, _ in committed_profiles(family, device)]
    assert len(found) == 6 and set(found) <= shipped
    assert {p.device.split(":")[0] for _, p in committed_profiles("ouro", "cuda")} == {"cuda"}
