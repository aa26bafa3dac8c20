"""User-level DP through `dptext finetune` (issue 24): recipe keys, the loop's per-user micro-batches, the
sensitivity of the loop's clipped sum to one user, every output naming the unit, resume, and the refusals."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from dptext import config
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.finetune import run_finetune
from dptext.finetune.loop import train_step
from dptext.finetune.setup import build_training
from dptext.data.users import user_groups
from dptext.finetune.user_level import micro_batches_by_user
from dptext.privacy.sampling.user_sampler import UserBatch

pytestmark = pytest.mark.integration

K = 3
WORDS = ["good", "bad", "fine", "great", "awful", "dull", "bright", "slow"]


def write_data(folder, users: int = 12):
    """A tiny labelled jsonl folder whose records carry a "user" field; users own 1 … 5 records each."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"{WORDS[(u + i) % 8]} {WORDS[(3 * u + i) % 8]} item {i}", "label": (u + i) % 2,
             "user": f"u{u}"} for u in range(users) for i in range(1 + u % 5)]
    for split, part in (("train", rows), ("validation", rows[:6]), ("test", rows[:6])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder, rows


def overrides(data, *extra: str) -> list[str]:
    return ["model.name=tiny-bert", "task.type=classification", "data.dataset=jsonl", f"data.path={data}",
            "data.max_length=16", "eval.split=validation", "task.labels=[0, 1]", "train.batch_size=4",
            "train.max_steps=3", "train.log_every=1", "train.learning_rate=1e-3", "privacy.target_epsilon=8",
            "privacy.unit=user", "data.user_column=user", f"privacy.max_examples_per_user={K}",
            "train.physical_batch_size=4", "name=users", *extra]


def recipe(data, *extra: str):
    return config.load_recipe(None, overrides(data, *extra))


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_user_level_run_names_the_unit_everywhere(mode, tmp_path, capsys):
    data, rows = write_data(tmp_path / "data")
    run = tmp_path / "run"
    result = run_finetune(recipe(data, f"privacy.clipping_mode={mode}"), out=run)
    privacy = result["privacy"]
    users = len({r["user"] for r in rows})
    assert privacy["unit"] == "user" and privacy["max_examples_per_user"] == K and "users" not in privacy
    assert privacy["dataset_size"] == users and privacy["counted"] == "users"
    assert privacy["sample_rate"] == pytest.approx(4 / users)  # q over users, not examples
    assert privacy["expected_batch_size"] == pytest.approx(4.0)
    assert privacy["delta"] == pytest.approx(1 / (2 * users)) and f"n={users} users" in privacy["delta_source"]
    assert privacy["mechanism"]["unit"] == "user" and f"at most {K}" in privacy["mechanism"]["guarantee"]
    assert "one user" in privacy["privacy_unit"]
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["unit"] == "user" and ledger["epsilon_is"] == f"per user (≤ {K} examples each)"
    assert ledger["dataset_size"] == users and ledger["steps"] == 3
    assert ledger["mechanism"]["max_examples_per_user"] == K
    manifest = json.loads((run / "release.json").read_text())
    assert manifest["privacy_unit"]["unit"] == "user" and manifest["privacy_unit"]["max_examples_per_user"] == K
    assert "one user" in manifest["statuses"]["covered"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["account", str(run)])
    assert code.value.code == 0
    printed = capsys.readouterr()
    assert f"per user (≤ {K} examples each)" in printed.out + printed.err


def test_example_level_ledger_and_account_say_per_example(tmp_path, capsys):
    data, rows = write_data(tmp_path / "data")
    run = tmp_path / "run"
    result = run_finetune(recipe(data, "privacy.unit=example", "privacy.max_examples_per_user=null",
                                 "train.max_steps=1"), out=run)
    assert result["privacy"]["unit"] == "example" and result["privacy"]["dataset_size"] == len(rows)
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["unit"] == "example" and ledger["epsilon_is"] == "per example"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["account", str(run)])
    printed = capsys.readouterr()
    assert "per example" in printed.out + printed.err and "per user" not in printed.out + printed.err


def _clipped_sum(training, sampled) -> dict[str, torch.Tensor]:
    """The loop's clipped sum for one step (``train_step`` up to the noise), by parameter name."""
    engine, kept = training.engine, {}
    names = {p: n for n, p in training.model.named_parameters()}

    def capture():
        kept.update({names[p]: g.clone() for p, g in engine.clipped_grads().items()})
        engine.zero_grad()
    engine.step = capture
    train_step(training, sampled)
    return kept


def _brute_force(model, task, examples, groups, clip: float) -> dict[str, torch.Tensor]:
    """Σ_users clip_C(∇ Σ_{i∈user} loss_i) by per-user autograd on an untouched copy of the model."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for rows in groups:
        batch = task.collate([examples[i] for i in rows])
        grads = torch.autograd.grad(task.per_example_loss(model, batch).sum(), list(params.values()),
                                    allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        factor = min(1.0, clip / (norm + 1e-6))
        for name, grad in zip(params, grads):
            total[name] += factor * grad
    return total


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "per_sample"])
def test_loop_clips_each_user_once_and_one_user_moves_the_sum_by_at_most_c(mode, tmp_path):
    data, _ = write_data(tmp_path / "data")
    extra = (f"privacy.clipping_mode={mode}", "privacy.max_grad_norm=0.05")
    training = build_training(recipe(data, *extra))
    reference = build_training(recipe(data, *extra, "privacy.enabled=false"))  # same seed: same weights
    training.model.eval()
    reference.model.eval()
    assert all(torch.equal(a, b) for a, b in zip(training.model.state_dict().values(),
                                                 reference.model.state_dict().values()))
    groups = [own[:K] for own in training.users][:6]  # six users, their first ≤ k examples
    indices = [i for own in groups for i in own]
    owners = [u for u, own in enumerate(groups) for _ in own]
    assert max(len(own) for own in groups) > 1, "the test needs users with several examples"
    full = _clipped_sum(training, UserBatch(indices, owners))
    expected = _brute_force(reference.model, reference.task, reference.examples, groups, 0.05)
    for name, value in full.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-7, msg=name)
    moves = []
    for removed in range(len(groups)):
        rest = [(i, u) for i, u in zip(indices, owners) if u != removed]
        without = _clipped_sum(training, UserBatch([i for i, _ in rest], [u for _, u in rest]))
        moves.append(math.sqrt(sum(float((full[n] - without[n]).double().pow(2).sum()) for n in full)))
    assert max(moves) <= 0.05 * (1 + 1e-4), moves
    # the bound is tight for a user whose summed gradient is clipped: removing it moves the sum by C
    assert max(moves) == pytest.approx(0.05, rel=1e-3), moves


def test_micro_batches_never_split_a_user():
    indices, users = [0, 1, 2, 3, 4, 5, 6], [7, 7, 3, 3, 3, 9, 1]
    chunks = list(micro_batches_by_user(indices, users, 4))
    assert chunks == [([0, 1], [7, 7]), ([2, 3, 4, 5], [3, 3, 3, 9]), ([6], [1])]
    with pytest.raises(UserError, match="physical_batch_size"):
        list(micro_batches_by_user([0, 1, 2], [5, 5, 5], 2))


def test_users_come_from_the_user_field_in_order_of_first_appearance():
    records = [{"user": "b"}, {"user": "a"}, {"user": "b"}, {"user": "c"}]
    assert user_groups(records) == [[0, 2], [1], [3]]
    with pytest.raises(UserError, match="Training record 2 has no user"):
        user_groups([{"user": "a"}, {"text": "x"}])


def test_resume_is_exact_under_user_level_sampling(tmp_path, interrupt_training):
    data, _ = write_data(tmp_path / "data")
    extra = ("train.max_steps=4", "train.checkpoint_every=2", "privacy.reproducible_noise=true")
    run_finetune(recipe(data, *extra), out=tmp_path / "a")
    resume_normally = interrupt_training(3)  # killed in step 3, after the checkpoint of step 2
    with pytest.raises(KeyboardInterrupt):
        run_finetune(recipe(data, *extra), out=tmp_path / "b")
    resume_normally()
    resumed = run_finetune(resume=tmp_path / "b")
    final = [torch.load(tmp_path / run / "checkpoints" / "step-00000004.pt", weights_only=False)["model"]
             for run in ("a", "b")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert resumed["privacy"]["unit"] == "user" and resumed["privacy"]["steps"] == 4
    diagnostics = [json.loads(line) for line in (tmp_path / "a" / "diagnostics_not_private.jsonl").read_text()
                   .splitlines()]
    again = [json.loads(line) for line in (tmp_path / "b" / "diagnostics_not_private.jsonl").read_text()
             .splitlines()]
    assert [d.get("batch_size") for d in diagnostics] == [d.get("batch_size") for d in again]


REFUSALS = [
    (("privacy.max_examples_per_user=null",), "needs privacy.max_examples_per_user"),
    (("data.user_column=null",), "needs data.user_column"),
    (("train.physical_batch_size=2",), "exceeds train.physical_batch_size=2"),
    (("privacy.method=edp_sgd",), "eDP-SGD clips micro-batch slots"),
]


@pytest.mark.parametrize("extra, words", REFUSALS)
def test_refusals_are_one_sentence_before_any_data_is_read(extra, words, tmp_path, monkeypatch):
    data, _ = write_data(tmp_path / "data")
    from dptext.finetune import setup

    monkeypatch.setattr(setup, "load_splits", lambda recipe: pytest.fail("data was read before the refusal"))
    with pytest.raises(UserError) as refused:
        run_finetune(recipe(data, *extra), out=tmp_path / "run")
    message = str(refused.value)
    assert words in message and not re.search(r"[.;]\s+[A-Z]", message) and message.endswith(".")
    assert not (tmp_path / "run").exists()
    if "max_examples_per_user" in words:
        assert "dptext data" in message and "--user-column" in message


def test_max_examples_per_user_only_with_user_unit(tmp_path):
    with pytest.raises(UserError, match="applies only with privacy.unit=user"):
        config.load_recipe(None, ["privacy.max_examples_per_user=3"])


def test_torchrun_refuses_user_level_before_reading_data(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dptext.finetune import run as finetune_run
    from dptext.finetune import setup
    from dptext.finetune.user_level import check_single_process

    data, _ = write_data(tmp_path / "data")
    monkeypatch.setattr(finetune_run, "current", lambda device: SimpleNamespace(active=True, is_writer=True))
    monkeypatch.setattr(setup, "load_splits", lambda recipe: pytest.fail("data was read before the refusal"))
    with pytest.raises(UserError, match="not supported under torchrun") as refused:
        run_finetune(recipe(data), out=tmp_path / "run")
    assert not re.search(r"[.;]\s+[A-Z]", str(refused.value)) and not (tmp_path / "run").exists()
    check_single_process(recipe(data), distributed=False)
    check_single_process(recipe(data, "privacy.unit=example", "privacy.max_examples_per_user=null"), True)


def test_record_without_user_is_refused_by_position(tmp_path, capsys):
    data, rows = write_data(tmp_path / "data")
    rows[4].pop("user")
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="1 of [0-9]+ training records of jsonl have no user"):
        run_finetune(recipe(data), out=tmp_path / "run")
    recipe_file = tmp_path / "users.yaml"
    recipe_file.write_text(config.dump_recipe(recipe(data)))
    with pytest.raises(SystemExit) as code:  # `dptext check` reads the local training split and says the same
        main(["check", str(recipe_file)])
    assert code.value.code == 2 and "training records of jsonl have no user" in capsys.readouterr().err


def test_non_private_baseline_ignores_the_unit(tmp_path):
    data, rows = write_data(tmp_path / "data")
    result = run_finetune(recipe(data, "privacy.enabled=false", "train.max_steps=1"), out=tmp_path / "run")
    assert not result["privacy"]["private"] and result["privacy"]["dataset_size"] == len(rows)


def test_sigma_listing_does_not_count_examples_as_users(tmp_path):
    from dptext.accounting.plan import recipe_sigmas

    data, _ = write_data(tmp_path / "data")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "users.yaml").write_text(config.dump_recipe(recipe(data)))
    (tmp_path / "recipes" / "examples.yaml").write_text(config.dump_recipe(
        recipe(data, "privacy.unit=example", "privacy.max_examples_per_user=null")))
    rows = {row["recipe"]: row for row in recipe_sigmas(8.0, tmp_path / "recipes", train_size=lambda data: 100)}
    assert rows["users"]["noise_multiplier"] is None and "counts users" in rows["users"]["note"]
    assert rows["examples"]["noise_multiplier"] > 0 and rows["examples"]["dataset_size"] == 100
