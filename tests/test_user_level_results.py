"""benchmarks/user_level.py: the user-level block of docs/results.md is what benchmarks/results/user_level.json
says, and a setting that has not finished shows as running, never as a number."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


user_level = _load("user_level")


def test_readme_block_matches_the_result_file():
    text = (ROOT / "docs" / "results.md").read_text()
    block = text.split(user_level.BEGIN, 1)[1].split(user_level.END, 1)[0].strip("\n")
    assert block == user_level.render(user_level.load()), "stale: run `python benchmarks/user_level.py readme`"


def test_rows_render_numbers_and_running_settings(tmp_path):
    row = {"accuracy": 87.125, "epsilon_rdp": 7.99, "epsilon_pld": 7.41, "delta": 7.98e-5, "unit": "user",
           "users": 5806, "k": 3, "examples": 6261, "wall_seconds": 2700.0, "machine": "m", "commit": "c"}
    lines = user_level.render({"user-level ε = 8": row}).splitlines()
    assert lines[2] == "| user-level ε = 8 | 87.12 | 7.99 | 7.41 | 8e-05 | user | 5,806 | 3 | 6,261 | 0.75 |"
    assert all("running" in line for line in lines[3:5]) and lines[-1] == "Code: c. Machine: m."


def test_the_job_file_names_every_setting_with_its_recipe(tmp_path):
    lines = user_level.job_file(tmp_path).read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["user-level/user", "user-level/example", "user-level/nonprivate"]
    assert all((ROOT / line.split()[1]).is_file() for line in lines)
    assert "privacy.enabled=false" in lines[2] and "{data}/amazon_multidomain_sentiment" in lines[0]
