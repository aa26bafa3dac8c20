"""Label sets are declared public inputs: the head's size and saved label names never come from the records."""

from __future__ import annotations

import pytest

from dptext import config
from dptext.errors import UserError
from dptext.models import load_tokenizer
from dptext.tasks import build_task
from dptext.tasks.encoding import IGNORE_INDEX
from dptext.tasks.label_sets import bio_tags, class_index

CLASSIFY = ["task.type=classification", "model.name=tiny-bert", "data.dataset=jsonl", "data.label_column=label"]


def classification(records, *overrides):
    recipe = config.load_recipe(None, [*CLASSIFY, *overrides])
    return build_task(recipe, load_tokenizer("tiny-bert"), records)


def test_class_count_is_the_declared_set_not_the_largest_label_seen():
    records = [{"text": "a", "label": 0}, {"text": "b", "label": 1}]
    task = classification(records, "task.labels=[negative, neutral, positive, unused]")
    assert task.num_labels == 4  # a class that no record carries still has its row: the shape reveals nothing
    assert task.load_model().config.num_labels == 4


def test_string_labels_map_through_the_declared_set():
    records = [{"text": "a", "label": "positive"}, {"text": "b", "label": "negative"}]
    task = classification(records, "task.labels=[negative, positive]")
    assert [e.extra["label"] for e in task.encode(records)] == [1, 0]
    assert class_index(3, ["a", "b"]) is None and class_index("4", [1, 2, 4, 5]) == 2


def test_a_training_label_outside_the_set_is_refused_by_position_without_printing_it():
    records = [{"text": "a", "label": "negative"}, {"text": "b", "label": "positive"},
               {"text": "c", "label": "SECRETLABEL"}]
    with pytest.raises(UserError) as error:
        classification(records, "task.labels=[negative, positive]")
    assert "Training record 3" in str(error.value) and "SECRETLABEL" not in str(error.value)


def test_other_label_catches_undeclared_labels_when_the_recipe_asks():
    records = [{"text": "a", "label": "negative"}, {"text": "c", "label": "rare"}]
    task = classification(records, "task.labels=[negative, positive, other]", "task.other_label=other")
    assert [e.extra["label"] for e in task.encode(records)] == [0, 2]
    with pytest.raises(UserError, match="not in task.labels"):
        classification(records, "task.labels=[negative, positive]", "task.other_label=other")


def test_own_files_without_a_declared_set_are_refused_and_published_sets_are_used():
    with pytest.raises(UserError, match="declare the classes"):
        classification([{"text": "a", "label": 0}])
    recipe = config.load_recipe(None, ["task.type=classification", "model.name=tiny-bert", "data.dataset=sst2"])
    assert build_task(recipe, load_tokenizer("tiny-bert"), [{"text": "a", "label": 1}]).num_labels == 2


def intent_slot(records, *overrides):
    recipe = config.load_recipe(None, ["task.type=intent_slot", "data.dataset=atis", "model.name=tiny-bert",
                                       "task.intents=[flight, fare]", "task.slot_types=[city]", *overrides])
    return build_task(recipe, load_tokenizer("tiny-bert"), records)


def test_intent_slot_labels_are_the_declared_ones():
    task = intent_slot([{"tokens": ["to", "x"], "tags": ["O", "B-city"], "intent": "flight"}])
    assert task.intents == ["flight", "fare"] and task.tags == bio_tags(["city"]) == ["O", "B-city", "I-city"]
    assert task.load_model().labels == {"intents": ["flight", "fare"], "tags": ["O", "B-city", "I-city"]}


@pytest.mark.parametrize("record,what", [
    ({"tokens": ["a"], "tags": ["O"], "intent": "SECRETINTENT"}, "intent"),
    ({"tokens": ["a"], "tags": ["B-SECRETSLOT"], "intent": "flight"}, "slot tag"),
])
def test_undeclared_intent_or_tag_is_refused_before_training(record, what):
    good = {"tokens": ["a"], "tags": ["O"], "intent": "fare"}
    with pytest.raises(UserError) as error:
        intent_slot([good, record])
    message = str(error.value)
    article = "an" if what == "intent" else "a"
    assert (f"Training record 2 (counting from 1 in the order `dptext data --split train` lists them) has {article} "
            f"{what}" in message)
    assert "SECRET" not in message


def test_intent_slot_other_label_maps_intent_and_tags():
    records = [{"tokens": ["a", "b"], "tags": ["B-rare", "B-city"], "intent": "rare"}]
    task = intent_slot(records, "task.other_label=fare")
    example = task.encode(records)[0]
    assert example.extra["intent"] == 1 and example.extra["word_tags"] == [0, 1]  # O, B-city
    assert IGNORE_INDEX not in example.extra["word_tags"]
