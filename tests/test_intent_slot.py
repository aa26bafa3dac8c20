"""Joint intent + slot model: the CRF against enumeration, its privacy rule against per-example autograd,
word-piece labelling, and `dptext finetune` end to end on ATIS with tiny-bert (with and without the CRF)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from torch import nn

from dptext import config
from dptext.cli.app import main
from dptext.privacy import PrivacyEngine
from dptext.tasks.crf import CRF
from dptext.tasks.encoding import IGNORE_INDEX

MODES = ("bookkeeping", "ghost", "per_sample")


def random_crf(num_tags: int, seed: int = 0) -> CRF:
    torch.manual_seed(seed)
    crf = CRF(num_tags)
    with torch.no_grad():
        for param in crf.parameters():
            param.normal_()
    return crf


def path_score(crf: CRF, emissions, tags) -> torch.Tensor:
    score = crf.start[tags[0]] + crf.end[tags[-1]] + sum(emissions[t, tag] for t, tag in enumerate(tags))
    return score + sum(crf.transitions[a, b] for a, b in zip(tags, tags[1:]))


# ---------------------------------------------------------------------------- the CRF itself

def test_crf_nll_and_viterbi_match_enumeration_of_all_paths():
    crf, num_tags, width = random_crf(3), 3, 4
    emissions = torch.randn(3, width, num_tags)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    tags = torch.randint(0, num_tags, (3, width))
    tags[mask == 0] = IGNORE_INDEX  # padding labels are ignored
    nll = crf(emissions, tags, mask)
    decoded = crf.decode(emissions, mask)
    for row in range(3):
        length = int(mask[row].sum())
        paths = list(itertools.product(range(num_tags), repeat=length))
        scores = torch.stack([path_score(crf, emissions[row], p) for p in paths])
        gold = path_score(crf, emissions[row], tags[row, :length].tolist())
        torch.testing.assert_close(nll[row], torch.logsumexp(scores, 0) - gold)
        assert tuple(decoded[row]) == paths[int(scores.argmax())]


class EmitAndTag(nn.Module):
    """Linear emissions → CRF: the slot layer of the joint model in miniature."""

    def __init__(self, d: int, num_tags: int):
        super().__init__()
        self.emit = nn.Linear(d, num_tags)
        self.crf = random_crf(num_tags, seed=1)

    def forward(self, x, tags, mask):
        return self.crf(self.emit(x), tags, mask)


@pytest.mark.parametrize("mode", MODES)
def test_crf_rule_clips_like_per_example_autograd(mode):
    torch.manual_seed(2)
    model = EmitAndTag(5, 4)
    x, tags = torch.randn(6, 7, 5), torch.randint(0, 4, (6, 7))
    mask = (torch.arange(7) < torch.tensor([7, 5, 3, 1, 7, 2]).unsqueeze(1)).long()
    reference, clip = copy.deepcopy(model), 4.5
    params = list(reference.parameters())
    rows = [torch.autograd.grad(reference(x[i:i + 1], tags[i:i + 1], mask[i:i + 1]).sum(), params)
            for i in range(len(x))]
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in row]).sum().sqrt() for row in rows])
    coef = (clip / (norms + 1e-6)).clamp(max=1)
    expected = [sum(c * row[k] for c, row in zip(coef, rows)) for k in range(len(params))]
    assert (norms > clip).any() and (norms < clip).any(), "the case must clip some examples and not others"

    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                           max_grad_norm=clip, expected_batch_size=6, dataset_size=60, clipping_mode=mode, verify=False)
    torch.testing.assert_close(engine.accumulate(model(x, tags, mask)), norms, rtol=1e-4, atol=1e-6)
    got = engine.clipped_grads()
    errors = {name: float((got[p] - e).abs().max()) for (name, p), e in zip(model.named_parameters(), expected)}
    assert all(err < 1e-4 for err in errors.values()), f"per-parameter max abs errors: {errors}"


# ---------------------------------------------------------------------------- labelling word-pieces

def task_for(*overrides: str):
    from dptext.models import load_tokenizer
    from dptext.tasks import build_task

    recipe = config.load_recipe(None, ["task.type=intent_slot", "data.dataset=atis", "task.intents=[flight, airfare]",
                                       "task.slot_types=[toloc]", *overrides])
    train = [{"tokens": ["fly", "to", "boston"], "tags": ["O", "O", "B-toloc"], "intent": "flight"},
             {"tokens": ["fares", "please"], "tags": ["O", "O"], "intent": "airfare"}]
    return build_task(recipe, load_tokenizer(recipe.model.name), train)


def test_tags_sit_on_the_first_word_piece_and_truncated_words_are_predicted_o():
    task = task_for("model.name=tiny-bert", "data.max_length=8")  # byte-level: one piece per character
    record = {"tokens": ["to", "boston", "now"], "tags": ["O", "B-toloc", "B-unseen"], "intent": "unseen"}
    example = task.encode([record])[0]
    # <s> t o b o s t o ... cut at 8 pieces: words "to" (positions 1-2) and "boston" (from 3) survive
    assert example.extra["word_index"] == [1, 3]
    assert example.labels == [IGNORE_INDEX, task.tag_ids["O"], IGNORE_INDEX, task.tag_ids["B-toloc"]] + \
        [IGNORE_INDEX] * 4
    assert example.extra["intent"] == IGNORE_INDEX  # an intent never seen in training cannot be a target
    model = task.load_model()
    scores = task.evaluate(model, [record], batch_size=4)
    assert set(scores) == {"intent_acc", "slot_f1", "ser", "sentence_acc"}
    assert scores["intent_acc"] == 0.0  # "unseen" is not among the predictable intents


# ---------------------------------------------------------------------------- end to end

def finetune(tmp_path, shared_data, capsys, recipe: str, *extra: str) -> dict:
    args = ["finetune", f"recipes/{recipe}.yaml", f"data.path={shared_data}/atis", "model.name=tiny-bert",
            "model.adaptation=full", "data.max_train_examples=96", "data.max_eval_examples=24",
            "train.batch_size=24", "train.max_steps=3", "train.log_every=1", "train.learning_rate=5e-3",
            *extra, "--out", str(tmp_path / "run"), "--json"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(args)
    assert code.value.code == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.integration
@pytest.mark.parametrize("recipe,extra", [
    ("atis-dpsgd", ()), ("atis-dpsgd", ("task.crf=true",)), ("atis-dpsgd", ("privacy.enabled=false",)),
    ("atis-edp", ("task.crf=true", "privacy.edp_micro_batches_per_device=2")),
])
def test_finetune_cli_on_atis_writes_run_and_scores(recipe, extra, tmp_path, shared_data, capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the recipes/ paths
    result = finetune(tmp_path, shared_data, capsys, recipe, *extra)
    run = tmp_path / "run"
    for name in ("resolved.yaml", "metrics.jsonl", "result.json", "model/config.json",
                 "model/intent_slot_heads.pt", "model/intent_slot_labels.json"):
        assert (run / name).exists(), name
    scores = result["metrics"]
    assert result["primary_metric"] == "ser" and result["task"] == "intent_slot"
    assert 0 <= scores["intent_acc"] <= 100 and 0 <= scores["slot_f1"] <= 100 and scores["ser"] >= 0
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["ser"] == scores["ser"] and final["split"] == "test"
    heads = torch.load(run / "model" / "intent_slot_heads.pt", weights_only=False)["classifier"]
    assert ("crf.transitions" in heads) == ("task.crf=true" in extra)
    labels = json.loads((run / "model" / "intent_slot_labels.json").read_text())
    assert heads["slot.weight"].shape[0] == len(labels["tags"])
    if "privacy.enabled=false" not in extra:
        assert result["privacy"]["private"] and result["privacy"]["epsilon"]["rdp"]["epsilon"] == \
            pytest.approx(8.0, rel=1e-3)
        if "task.crf=true" in extra:  # the CRF transitions are trained (clipped and noised) like the rest
            start = torch.load(run / "checkpoints" / "step-00000003.pt", weights_only=False)["model"]
            assert start["classifier.crf.transitions"].abs().sum() > 0
