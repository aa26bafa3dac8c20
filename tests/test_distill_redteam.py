"""Red-team checks of DistilDP (`dptext synth`, `dptext distill`): settings that must be refused because the
claimed (ε, δ) would not hold for what is published.

Cheap: teacher run directories are faked on disk (resolved.yaml, result.json, model/config.json, release.json),
no model is trained; every refusal must come before a model loads or a file of the output is written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from dptext.config import load_recipe
from dptext.config.loader import dump_recipe
from dptext.distill.codes import code_distribution
from dptext.distill.run import check_recipe, dpkd_budget
from dptext.distill.synth import synthesize
from dptext.errors import UserError
from dptext.runs import write_manifest

DATA = Path(os.environ.get("DPTEXT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
AMAZON = DATA / "amazon_multidomain_sentiment"
SLICE = {"dataset": "amazon", "path": str(AMAZON), "max_train_examples": 48, "max_eval_examples": 8,
         "max_length": 40}
DOMAIN = {"category": ["books", "dvd", "electronics", "kitchen & housewares"], "rating": [1, 2, 4, 5]}
TASK = {"type": "language_modeling", "control_codes": ["category", "rating"], "code_domain": DOMAIN}
RECORDS = [{"category": "books", "rating": 5}] * 6 + [{"category": "dvd", "rating": 4}] * 3


def recipe_from(path: Path, **sections):
    path.write_text(yaml.safe_dump(sections), encoding="utf-8")
    return load_recipe(path)


def fake_run(root: Path, name: str, *, private: bool = True, epsilon: float = 1.0, delta: float = 1e-5,
             data: dict | None = None, privacy: dict | None = None) -> Path:
    """A finished finetune run directory as teacher_info / check_recipe read it (no weights)."""
    run = root / name
    (run / "model").mkdir(parents=True)
    recipe = recipe_from(root / f"{name}.yaml", name=name, model={"name": "tiny-llama"}, data=data or SLICE,
                         task=TASK, privacy=privacy or {"enabled": private, "target_epsilon": epsilon,
                                                        "delta": delta})
    (run / "resolved.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    (run / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    block = ({"private": True, "epsilon": {"rdp": {"epsilon": epsilon}}, "delta": delta, "accountant": "rdp"}
             if private else {"private": False, "note": "non-private baseline"})
    (run / "result.json").write_text(json.dumps({"privacy": block, "task": "language_modeling"}))
    write_manifest(run, "run", [] if private else ["non_private"])
    return run


@pytest.fixture
def amazon():
    if not AMAZON.is_dir():
        pytest.skip(f"shared datasets not found at {DATA}")


# --------------------------------------------------------------------------- the student's starting weights

def test_student_from_a_run_directory_model_is_refused(tmp_path, amazon):
    """student_init/ is registered PUBLIC ("cut from a public pretrained model") and the student's claim counts
    only the teacher / its own steps. A distill.student that is a run's model/ (here a NON-private fine-tune of
    the private data) is private weights: copied into a 'public' folder and under a DP claim that never paid
    for them. It must be refused."""
    leaky = fake_run(tmp_path, "nonprivate", private=False)
    recipe = recipe_from(tmp_path / "student.yaml", name="student", data=SLICE, task=TASK,
                         privacy={"target_epsilon": 2.0},
                         distill={"method": "dp_sgd", "student": str(leaky / "model")})
    with pytest.raises(UserError, match="run directory"):
        check_recipe(recipe)


# --------------------------------------------------------------------------- the evaluation split

@pytest.mark.parametrize("method", ["dpkd", "zero_shot"])
def test_student_scored_on_a_split_that_holds_the_teachers_training_records_is_refused(tmp_path, amazon, method):
    """Every method scores the student on the distill recipe's eval split and writes that perplexity into the
    covered result.json. When the distill recipe partitions the data differently from the teacher's (another
    split_seed here), that split holds the teacher's training records: an un-noised statistic of them, released
    as covered. Refused; the same data section is accepted."""
    teacher = fake_run(tmp_path, "teacher", epsilon=1.0, delta=1e-5)
    distill = {"method": method, "teacher": str(teacher), "student_layers": [0]}
    same = recipe_from(tmp_path / "same.yaml", name="same", data=SLICE, task=TASK,
                       privacy={"target_epsilon": 2.0}, distill=distill)
    check_recipe(same)  # accepted
    other = recipe_from(tmp_path / "other.yaml", name="other", data={**SLICE, "split_seed": 7}, task=TASK,
                        privacy={"target_epsilon": 2.0}, distill=distill)
    with pytest.raises(UserError, match="teacher"):
        check_recipe(other)


# --------------------------------------------------------------------------- δ too large

def test_dpkd_total_delta_of_0_1_or_more_is_refused_like_finetune(tmp_path):
    """finetune refuses δ ≥ 0.1 without privacy.allow_large_delta. DPKD checks only the student's share: a total
    δ = 0.15 with a teacher at 0.06 leaves the student 0.09 and the composed claim δ = 0.15 went out unrefused."""
    recipe = recipe_from(tmp_path / "dpkd.yaml", name="dpkd", data=SLICE, task=TASK,
                         privacy={"target_epsilon": 4.0, "delta": 0.15},
                         distill={"method": "dpkd", "teacher": "unused"})
    teacher = {"privacy": {"private": True, "epsilon": 1.0, "delta": 0.06}}
    with pytest.raises(UserError, match="allow_large_delta"):
        dpkd_budget(recipe, teacher, n=1000)
    allowed = recipe_from(tmp_path / "ok.yaml", name="ok", data=SLICE, task=TASK,
                          privacy={"target_epsilon": 4.0, "delta": 0.15, "allow_large_delta": True},
                          distill={"method": "dpkd", "teacher": "unused"})
    assert dpkd_budget(allowed, teacher, n=1000)["total_delta"] == 0.15


def test_gaussian_code_histogram_with_a_large_delta_is_refused():
    """--code-delta 0.5 was accepted: a histogram that may publish the exact counts with probability 1/2,
    added to the teacher's δ and reported as a DP claim."""
    with pytest.raises(UserError, match="δ"):
        code_distribution(RECORDS, ["category", "rating"], "gaussian", epsilon=1.0, delta=0.5, domain=DOMAIN)


def test_synth_composed_delta_of_0_1_or_more_is_refused(tmp_path, amazon):
    """Teacher δ 0.06 + code histogram δ 0.06: each part passes, the synthetic data's claimed δ = 0.12 must not."""
    teacher = fake_run(tmp_path, "teacher", epsilon=1.0, delta=0.06)
    out = tmp_path / "synthetic"
    with pytest.raises(UserError, match="δ"):
        synthesize(teacher, out, n=4, code_mechanism="gaussian", code_epsilon=1.0, code_delta=0.06,
                   max_new_tokens=2, batch_size=4, validation_fraction=0)
    assert not (out / "plan.json").exists()


# --------------------------------------------------------------------------- ε of the histogram

@pytest.mark.parametrize("epsilon", [math.inf, math.nan])
def test_laplace_code_histogram_needs_a_finite_epsilon(epsilon):
    """--code-epsilon inf gave Laplace noise of scale 0: plan.json published the EXACT private code counts under
    the key 'noisy_counts' (a covered file)."""
    with pytest.raises(UserError, match="code-epsilon"):
        code_distribution(RECORDS, ["category", "rating"], "laplace", epsilon=epsilon, domain=DOMAIN)


# --------------------------------------------------------------------------- caveats a teacher hands on

def test_a_teachers_unverified_clipping_is_stated_by_what_learns_from_it(tmp_path, amazon):
    """A teacher trained with privacy.verify=false has 'clipping_not_verified' in its release.json: its ε rests on
    the layer rules alone. Synthetic data and students claim that same ε (inherited_flags feeds their
    release.json) but drop the caveat, so their release.json reads as an unconditional guarantee.
    (Cosmetic: statuses need not change, only the flag must travel.)"""
    from dptext.release import inherited_flags

    teacher = fake_run(tmp_path, "teacher", privacy={"target_epsilon": 1.0, "delta": 1e-5, "verify": False})
    write_manifest(teacher, "run", ["clipping_not_verified"])
    assert "clipping_not_verified" in inherited_flags(teacher)
