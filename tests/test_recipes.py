"""Every shipped recipe validates against the schema and says how to run it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptext import config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert RECIPES, "recipes/ is empty"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_validates_and_shows_its_command(path):
    recipe = config.load_recipe(path)
    assert recipe.name == path.stem, "a recipe's name should match its file name"
    assert recipe.description, "every recipe says what it reproduces"
    header = path.read_text().splitlines()[:4]
    assert any(line.startswith("# Run:") and path.name in line for line in header), "header must show the command"
