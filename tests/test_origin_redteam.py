"""Red team of ``model/dptext_origin.json`` (``dptext.release.ORIGIN``): a copy of a run's ``model/`` made outside
its run must not start a new output with a silently wrong privacy claim.

Found: a copied model folder was a public ``distill.student`` (its weights, learnt from the private data, went into
the student's ``student_init/``, registered public, and the student's claim left them out).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptext import config
from dptext.distill.run import check_public_student, run_distill
from dptext.errors import UserError


def copied_model(folder: Path, flags: list[str]) -> Path:
    """A run's model/ copied to ``folder``, its marker with it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "dptext_origin.json").write_text(json.dumps({"written_by": "dptext", "kind": "run", "flags": flags}))
    return folder


@pytest.mark.parametrize("flags", [[], ["non_private"]])
def test_a_copied_model_folder_is_no_public_distill_student(tmp_path, flags):
    copy = copied_model(tmp_path / "elsewhere" / "my-model", flags)
    with pytest.raises(UserError, match="trained on private data"):
        check_public_student(str(copy))
    recipe = config.load_recipe(None, [
        "model.name=tiny-llama", "task.type=language_modeling", f"data.path={tmp_path / 'none.csv'}",
        "name=student", "privacy.target_epsilon=8", "distill.method=dp_sgd", f"distill.student={copy}"])
    with pytest.raises(UserError, match="distill.student"):
        run_distill(recipe, out=tmp_path / "student")
    assert not (tmp_path / "student" / "student_init").exists()
