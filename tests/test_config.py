"""Recipe schema: strict loading, typed coercion, dotted overrides, documented fields."""

from __future__ import annotations

import pytest

from dptext import config
from dptext.errors import UserError


def test_defaults_follow_the_paper():
    recipe = config.Recipe()
    assert recipe.privacy.max_grad_norm == 0.1  # Li et al. App. H
    assert recipe.privacy.sampling == "poisson"
    assert recipe.privacy.clipping_mode == "bookkeeping"
    assert recipe.train.optimizer == "adam" and recipe.train.weight_decay == 0.0


def test_every_leaf_field_is_documented():
    rows = config.schema_docs()
    assert len(rows) > 30
    assert all(doc for _, _, _, doc in rows), [key for key, _, _, doc in rows if not doc]


def test_overrides_are_typed_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nprivacy:\n  target_epsilon: 8\n")
    recipe = config.load_recipe(path, ["privacy.target_epsilon=3", "train.epochs=1", "privacy.delta=1e-5",
                                       "privacy.enabled=false", "data.path=/some/where", "train.max_steps=7"])
    assert recipe.privacy.target_epsilon == 3.0 and isinstance(recipe.privacy.target_epsilon, float)
    assert recipe.train.epochs == 1.0 and recipe.privacy.delta == 1e-5
    assert recipe.privacy.enabled is False and recipe.data.path == "/some/where" and recipe.train.max_steps == 7


def test_yaml_scientific_notation_strings_become_floats(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  learning_rate: 5e-4\n")  # YAML 1.1 reads this as a string
    assert config.load_recipe(path).train.learning_rate == 5e-4


def test_name_defaults_to_the_file_stem(tmp_path):
    path = tmp_path / "my-recipe.yaml"
    path.write_text("train:\n  epochs: 2\n")
    assert config.load_recipe(path).name == "my-recipe"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("privacy.epsilon=3", "did you mean 'privacy.target_epsilon'"),
        ("privcy.target_epsilon=3", "did you mean 'privacy'"),
        ("train.batch_size=abc", "must be int"),
        ("train.batch_size=1.5", "must be int"),
        ("privacy.accountant=rpd", "did you mean 'rdp'"),
        ("privacy.enabled=maybe", "must be bool"),
        ("model=3", "must be a mapping"),
        ("train.epochs.x=3", "must be float"),
        ("train=1", "must be a mapping"),
        ("no-equals-sign", "key=value"),
        ("model.name=", "cannot be empty"),
    ],
)
def test_bad_values_are_one_sentence_user_errors(override, fragment):
    with pytest.raises(UserError) as exc:
        config.load_recipe(None, [override])
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("privacy:\n  target_epsilon: [3\n")
    with pytest.raises(UserError, match="not valid YAML"):
        config.load_recipe(path)


def test_round_trip_through_yaml(tmp_path):
    recipe = config.load_recipe(None, ["name=rt", "privacy.target_epsilon=3", "task.control_codes=[a, b]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config.dump_recipe(recipe))
    assert config.load_recipe(path) == recipe
