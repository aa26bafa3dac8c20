"""The front page and docs/: every relative link resolves, the generated references are current, the README is
short, carries no commit hash, and its results table says what docs/results.md says; every shipped recipe says
where its data comes from; every main command's --help has an example."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from dptext.cli.app import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "DEVELOPERS.md", ROOT / "benchmarks" / "RESULTS.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside one is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose(page.read_text(encoding="utf-8")), re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](nowhere.md) [b](#title) [c](#no-such) [d](https://example.org)\n"
                    "```\n[e](not-a-link.md)\n```\n")
    assert broken_links(page) == ["nowhere.md (no such file)", "#no-such (no heading #no-such)"]


def test_generated_references_are_current():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "reference" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.stale() == [], "stale: run `python docs/reference/generate.py`"


def test_readme_is_a_short_front_page_without_commit_hashes():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert hashes == []


def test_readme_results_rows_match_the_generated_tables():
    """Each number in the README's results table appears in docs/results.md or the page its row links to."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Results"):readme.index("## Documentation")]
    for row in [line for line in table.splitlines() if line.startswith("| ") and "](" in line]:
        target = re.search(r"\]\(([^)#]+)", row).group(1)
        details = (ROOT / target).read_text(encoding="utf-8")
        cells = row.split("|")[2:-2]  # the non-private and DP columns
        for number in re.findall(r"\d+\.\d+|\d{3,}", " ".join(cells)):
            assert number in details, f"{number} of README row {row[:40]!r} is not in {target}"


def test_every_shipped_recipe_says_where_its_data_comes_from():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        header = [line for line in recipe.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
        assert any(line.startswith("# Data: ") for line in header), recipe.name


@pytest.mark.parametrize("command", [["finetune"], ["check"], ["synth"], ["distill"], ["mia"], ["mia", "canary"]])
def test_help_shows_a_working_example(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "Example" in shown and f"dptext {' '.join(command)} " in shown
    if command == ["mia", "canary"]:  # its own help, not the membership-inference one
        assert "--compare-units" in shown and "--attack" not in shown


def test_the_readmes_own_data_recipe_and_commands_work_as_written(tmp_path, capsys, monkeypatch):
    """The README's "Your own data" section, run as written on a CSV with string labels (finetune with a tiny
    model and two steps, so the test stays fast): a first try that works."""
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Your own data"):readme.index("## Main uses")]
    recipe = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in re.search(r"```bash\n(.*?)```", section, re.S).group(1)
                .splitlines() if line.strip()]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-recipe.yaml").write_text(recipe)
    (tmp_path / "tickets.csv").write_text("text,label\n" + "".join(
        f"\"ticket {i}: {'works, thanks' if i % 2 else 'still broken'}\",{'positive' if i % 2 else 'negative'}\n"
        for i in range(200)))
    assert [shlex.split(c)[1] for c in commands] == ["data", "check", "finetune"]
    for command in commands:
        args = shlex.split(command)[1:]
        if args[0] == "finetune":
            args += ["model.name=tiny-bert", "train.max_steps=2", "data.max_length=32", "data.max_eval_examples=8",
                     "--out", "run"]
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]["accuracy"] >= 0
