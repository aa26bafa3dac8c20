"""The architecture as a contract (docs/ARCHITECTURE.md): import-linter's layers and no-cycle contracts from
pyproject.toml hold for the package, they would catch an upward import or a cycle, and library modules import
other dptext modules at the top (inside functions only in dptext/cli/, which keeps `dptext --help` fast)."""

from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from importlinter import configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]


def lint_imports_command() -> Path:
    command = Path(sys.executable).with_name("lint-imports")
    if not command.is_file():
        pytest.fail("lint-imports is missing; install the dev dependencies: pip install -e '.[dev]'")
    return command


def test_lint_imports_keeps_every_contract():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([str(lint_imports_command()), "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in done.stdout


def contract(kind: type, contract_type: str):
    options = next(c for c in CONTRACTS if c["type"] == contract_type)
    options = {key: value if isinstance(value, list) else str(value) for key, value in options.items()}  # as read
    return kind(name=options["name"], session_options={"root_packages": ["dptext"]}, contract_options=options)


@pytest.fixture(scope="module")
def graph():
    configuration.configure()  # the contracts time themselves through import-linter's settings
    sys.path.insert(0, str(ROOT))  # this checkout's dptext, not another one installed in the environment
    try:
        return grimp.build_graph("dptext", cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))


def test_layers_contract_refuses_an_upward_import(graph):
    layers = contract(LayersContract, "layers")
    assert layers.check(copy.deepcopy(graph), verbose=False).kept
    upward = copy.deepcopy(graph)  # the audit split reaching back into the training run it feeds
    upward.add_import(importer="dptext.data.audit_split", imported="dptext.finetune.run")
    assert not layers.check(upward, verbose=False).kept


def test_acyclic_contract_refuses_a_cycle_between_subpackages(graph):
    acyclic = contract(AcyclicSiblingsContract, "acyclic_siblings")
    assert acyclic.check(copy.deepcopy(graph), verbose=False).kept
    cyclic = copy.deepcopy(graph)  # models import runs (the cache folder); runs importing models closes a cycle
    cyclic.add_import(importer="dptext.runs", imported="dptext.models")
    assert not acyclic.check(cyclic, verbose=False).kept


def imports_inside_functions(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line module' for every import of a dptext module inside a function of ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                names = [("." * inner.level) + (inner.module or "")]
            elif isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            else:
                continue
            found += [f"{path.relative_to(root)}:{inner.lineno} {name}" for name in names
                      if name.startswith((".", "dptext"))]
    return sorted(set(found), key=lambda hit: int(hit.split(":")[1].split()[0]))  # nested functions: once


def test_library_modules_import_dptext_at_the_top():
    library = [p for p in sorted((ROOT / "dptext").rglob("*.py")) if "cli" not in p.relative_to(ROOT).parts[1:2]]
    inside = [hit for path in library for hit in imports_inside_functions(path)]
    assert not inside, "import these at the top of the module:\n" + "\n".join(inside)


def test_the_import_scan_sees_imports_inside_functions_only(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("from dptext.errors import UserError\n\n\ndef f():\n    from dptext.runs import RunDir\n"
                      "    import peft\n\n    def g():\n        from . import sibling\n    return RunDir, peft, g\n")
    assert imports_inside_functions(module, tmp_path) == ["probe.py:5 dptext.runs", "probe.py:9 ."]
