"""benchmarks/bench_grid.py: the resumable grid of issue 19, its README table and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_grid():
    spec = importlib.util.spec_from_file_location("bench_grid", ROOT / "benchmarks" / "bench_grid.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_grid"] = module
    spec.loader.exec_module(module)
    return module


grid = _load_grid()


def _fake_cell(calls):
    def measure_cell(model, seq_len, batch_size, steps, warmup, rounds):
        calls.append((model, seq_len, batch_size))
        context = {"machine": "test cpu", "date": "2026-11-23", "commit": "abc", "load_average": [0.5, 0.7]}
        return [{"model": model, "seq_len": seq_len, "batch_size": batch_size, "mode": mode, "status": "ok",
                 "time_s": 2.0 * ratio, "peak_mb": 100.0 * ratio, "time_ratio": ratio, "memory_ratio": ratio,
                 **context} for mode, ratio in (("nonprivate", 1.0), ("bookkeeping", 1.25))]
    return measure_cell


def test_grid_appends_each_cell_and_skips_finished_cells_on_rerun(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(grid, "measure_cell", _fake_cell(calls))
    path = tmp_path / "grid.json"
    grid.run_grid(path, ["minilm-l6"], (32,), (8,), 1, 0, 1, say=lambda text: None)
    assert calls == [("minilm-l6", 32, 8)] and len(json.loads(path.read_text())) == 2
    rows = grid.run_grid(path, ["minilm-l6"], (32, 64), (8,), 1, 0, 1, say=lambda text: None)
    assert calls == [("minilm-l6", 32, 8), ("minilm-l6", 64, 8)]  # T = 32 was not measured again
    assert {(r["seq_len"], r["mode"]) for r in rows} == {(32, "nonprivate"), (32, "bookkeeping"),
                                                         (64, "nonprivate"), (64, "bookkeeping")}
    assert json.loads(path.read_text()) == rows


def test_table_shows_ratios_machine_and_load(tmp_path):
    rows = _fake_cell([])("smollm2-135m", 64, 8, 1, 0, 1)
    rows.append(dict(rows[0], mode="opacus_untied", status="unsupported: tied weights", time_ratio=None))
    table = grid.render_table(rows)
    assert "| smollm2-135m | 64 | 8 | book-keeping | 2.50 | 1.25× | — | 125 | 1.25× | 0.5–0.7 |" in table
    rows[1]["noise_s"] = 0.0312
    assert "| book-keeping | 2.50 | 1.25× | 0.031 | 125 |" in grid.render_table(rows)
    assert "unsupported: tied weights" in table and "test cpu, 2026-11-23, commit abc" in table


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _fake_cell([])("minilm-l6", 32, 8, 1, 0, 1) + _fake_cell([])("minilm-l6", 64, 8, 1, 0, 1)
    grid.write_plot(rows, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"


def test_readme_block_is_rewritten_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{grid.BEGIN}\nold table\n{grid.END}\nafter\n")
    grid.rewrite_readme(readme, _fake_cell([])("minilm-l6", 32, 8, 1, 0, 1), tmp_path / "grid.json")
    text = readme.read_text()
    assert "old table" not in text and "| minilm-l6 | 32 | 8 | book-keeping |" in text
    assert text.startswith("before\n") and text.endswith(f"{grid.END}\nafter\n")
