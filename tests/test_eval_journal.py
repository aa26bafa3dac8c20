"""The final evaluation's journal: an evaluation cut off mid-way resumes with the batches it finished.

E2E's test-set generation and perplexity take about as long as training on the CPU, so `--resume` must not redo
them. Checked: a run killed inside its final evaluation resumes, generates only the batches it had not finished,
and reports exactly the metrics of a run straight through; a journal written for other weights (or records, or
settings) is never reused; a line torn by a kill is computed again.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dptext import config
from dptext.finetune import run_finetune
from dptext.tasks import eval_journal, generation
from dptext.tasks.eval_journal import EvaluationJournal, journaled_batches, weights_digest

pytestmark = pytest.mark.integration

RECIPE = ["model.name=tiny-gpt2", "data.dataset=e2e", "data.path={data}/e2e_nlg", "task.type=table_to_text",
          "eval.beam_size=2", "eval.max_new_tokens=4", "eval.batch_size=2", "data.max_train_examples=24",
          "data.max_eval_examples=80", "data.max_length=48", "train.batch_size=8", "train.max_steps=2",
          "privacy.target_epsilon=8", "privacy.reproducible_noise=true", "name=journal"]


def recipe(shared_data):
    return config.load_recipe(None, [o.format(data=shared_data) for o in RECIPE])


class Cut(Exception):
    """Stands for a kill in the middle of the final evaluation."""


def count_generate_calls(monkeypatch, cut_after: int | None = None) -> list[int]:
    """Counts model.generate calls made by evaluation; raises Cut on call ``cut_after + 1``."""
    calls: list[int] = []
    original = eval_journal.journaled_batches  # the real one, not an earlier patch

    def counting(items, size, compute, journal, part):
        def counted(chunk):
            if cut_after is not None and len(calls) == cut_after:
                raise Cut
            calls.append(len(chunk))
            return compute(chunk)
        return original(items, size, counted if part == "generate" else compute, journal, part)

    monkeypatch.setattr(generation, "journaled_batches", counting)
    return calls


def test_run_cut_inside_final_evaluation_resumes_without_redoing_finished_batches(shared_data, tmp_path,
                                                                                    monkeypatch):
    straight = run_finetune(recipe(shared_data), out=tmp_path / "straight")
    count_generate_calls(monkeypatch, cut_after=2)
    with pytest.raises(Cut):
        run_finetune(recipe(shared_data), out=tmp_path / "cut")
    assert not (tmp_path / "cut" / "result.json").exists()
    lines = (tmp_path / "cut" / "final_evaluation.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 2  # the identity, then the two generation batches finished before the cut

    resumed_calls = count_generate_calls(monkeypatch)
    resumed = run_finetune(resume=tmp_path / "cut")
    assert resumed["metrics"] == straight["metrics"]
    journal = [json.loads(line) for line in (tmp_path / "cut" / "final_evaluation.jsonl").read_text().splitlines()]
    generated = [entry["start"] for entry in journal[1:] if entry["part"] == "generate"]
    assert len(generated) > 3 and generated == sorted(set(generated))  # every batch once, in order
    assert len(resumed_calls) == len(generated) - 2, "a batch finished before the cut was generated again"
    assert any(entry["part"] == "perplexity" for entry in journal[1:])
    files = {f["path"]: f for f in json.loads((tmp_path / "cut" / "release.json").read_text())["files"]}
    assert files["final_evaluation.jsonl"]["status"] == "covered"
    # the finishing invocation says how long the batches it took from the journal had taken (for the wall time)
    reused = sum(entry["seconds"] for entry in journal[1:3])
    finished = [json.loads(line) for line in (tmp_path / "cut" / "diagnostics_not_private.jsonl").read_text()
                .splitlines() if '"finished"' in line][-1]
    assert reused > 0 and finished["evaluation_reused_seconds"] == pytest.approx(reused)


def test_journal_for_other_weights_or_records_is_started_afresh(tmp_path):
    path = tmp_path / "final_evaluation.jsonl"
    first = EvaluationJournal(path, {"step": 2, "weights": "a", "records": "r"})
    list(journaled_batches(list(range(6)), 2, lambda chunk: [x * 10 for x in chunk], first, "part"))
    assert len(first.done) == 3
    again = EvaluationJournal(path, {"step": 2, "weights": "a", "records": "r"})
    assert again.done == first.done
    for identity in ({"step": 2, "weights": "b", "records": "r"}, {"step": 2, "weights": "a", "records": "s"},
                     {"step": 3, "weights": "a", "records": "r"}):
        assert EvaluationJournal(path, identity).done == {}
        EvaluationJournal(path, {"step": 2, "weights": "a", "records": "r"})  # (the journal now holds no batch)
    computed: list[list[int]] = []
    fresh = EvaluationJournal(path, {"step": 2, "weights": "a", "records": "r"})
    out = list(journaled_batches(list(range(4)), 2, lambda c: computed.append(c) or c, fresh, "part"))
    assert computed == [[0, 1], [2, 3]] and [v for _, v in out] == [[0, 1], [2, 3]]


def test_torn_last_line_is_computed_again(tmp_path):
    path = tmp_path / "final_evaluation.jsonl"
    identity = {"step": 1}
    journal = EvaluationJournal(path, identity)
    list(journaled_batches(["a", "b", "c"], 1, lambda c: c[0].upper(), journal, "generate"))
    text = path.read_text()
    path.write_text(text[: len(text) - 9])  # a kill while the last batch's line was written
    computed: list[str] = []
    resumed = EvaluationJournal(path, identity)
    values = [v for _, v in journaled_batches(["a", "b", "c"], 1, lambda c: computed.append(c[0]) or c[0].upper(),
                                              resumed, "generate")]
    assert values == ["A", "B", "C"] and computed == ["c"]


def test_a_journal_adds_up_the_seconds_of_the_batches_it_hands_back(tmp_path, monkeypatch):
    path = tmp_path / "final_evaluation.jsonl"
    ticks = iter(range(0, 100, 5))  # each computed batch takes 5 s by this clock
    monkeypatch.setattr(eval_journal.time, "monotonic", lambda: float(next(ticks)))
    list(journaled_batches(["a", "b"], 1, lambda c: c, EvaluationJournal(path, {"step": 1}), "generate"))
    resumed = EvaluationJournal(path, {"step": 1})
    list(journaled_batches(["a", "b", "c"], 1, lambda c: c, resumed, "generate"))
    assert resumed.reused_seconds == 10.0  # a and b from disk; c computed now, counted by the invocation itself


def test_a_non_finite_batch_is_computed_again_never_read_back_as_a_string(tmp_path):
    """JSON has no NaN: a journaled NaN would come back as the string "nan" and break the resumed sum."""
    path = tmp_path / "final_evaluation.jsonl"
    values = {"a": (float("nan"), 3), "b": (1.5, 2)}
    list(journaled_batches(["a", "b"], 1, lambda c: values[c[0]], EvaluationJournal(path, {"step": 1}), "nll"))
    computed: list[str] = []
    resumed = [v for _, v in journaled_batches(["a", "b"], 1, lambda c: computed.append(c[0]) or values[c[0]],
                                               EvaluationJournal(path, {"step": 1}), "nll")]
    assert computed == ["a"] and math.isnan(resumed[0][0]) and resumed[1] == [1.5, 2]


def test_weights_digest_sees_any_change_in_any_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    before = weights_digest(model)
    assert weights_digest(model) == before
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-7
    assert weights_digest(model) != before
    changed = weights_digest(model)
    model[1].num_batches_tracked += 1  # an integer buffer counts too
    assert weights_digest(model) != changed
    assert weights_digest(model.to(torch.bfloat16)) != weights_digest(model.float())
    assert eval_journal.records_digest([{"a": 1}]) != eval_journal.records_digest([{"a": 2}])
