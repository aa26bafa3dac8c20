"""The README's library-API example runs exactly as written and spends the ε it was calibrated for."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The privacy engine (library API)"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_library_example_is_self_contained_and_runs():
    code = library_example()
    namespace: dict = {"__name__": "readme_example"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)  # only its own imports and definitions
    engine, delta = namespace["engine"], namespace["delta"]
    assert engine.steps == namespace["steps"] == 20
    spent = engine.epsilon(delta)
    assert abs(spent - 8.0) < 8.0 * 1e-3  # calibrated to the target within the calibration tolerance
    assert f"ε = {spent:.2f}" in printed.getvalue()
