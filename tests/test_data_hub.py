"""Hub readers: the mapping from each hub dataset's columns to dptext records, checked with a
stand-in for ``datasets.load_dataset`` (no hub here), and hub failures as one-sentence errors."""

from __future__ import annotations

import pytest

from dptext.data import load_split
from dptext.errors import UserError

datasets = pytest.importorskip("datasets")


class FakeHub:
    """Serves rows per (hub id, config, split) and records how each was asked for."""

    def __init__(self, tables):
        self.tables = tables
        self.calls = []

    def __call__(self, hub_id, config=None, *, split, revision=None, data_dir=None):
        self.calls.append({"hub_id": hub_id, "config": config, "split": split, "revision": revision,
                           "data_dir": data_dir})
        try:
            return self.tables[(hub_id, config, split)]
        except KeyError:
            raise ValueError(f'Unknown split "{split}". '
                             f'Should be one of {sorted(k[2] for k in self.tables)}.') from None


@pytest.fixture
def hub(monkeypatch):
    def install(tables):
        fake = FakeHub(tables)
        monkeypatch.setattr(datasets, "load_dataset", fake)
        return fake
    return install


def test_e2e_reads_the_parquet_export(hub):
    fake = hub({("tuetschek/e2e_nlg", None, "validation"): [
        {"meaning_representation": "name[A], food[Thai]", "human_reference": "A serves Thai food."}]})
    assert load_split("e2e", "validation") == [{"mr": "name[A], food[Thai]", "ref": "A serves Thai food."}]
    assert fake.calls == [{"hub_id": "tuetschek/e2e_nlg", "config": None, "split": "validation",
                           "revision": "refs/convert/parquet", "data_dir": "default"}]


def test_dart_unpacks_annotations_stored_as_a_dict_of_lists(hub):
    hub({("Yale-LILY/dart", None, "test"): [
        {"tripleset": [["A", "p", "B"]], "subtree_was_extended": False,
         "annotations": {"source": ["webnlg", "e2e"], "text": ["A p B.", "B is A's p."]}}]})
    assert load_split("dart", "test") == [
        {"tripleset": [["A", "p", "B"]], "ref": "A p B.", "source": "webnlg", "entry": 0},
        {"tripleset": [["A", "p", "B"]], "ref": "B is A's p.", "source": "e2e", "entry": 0}]


def test_glue_mnli_uses_matched_splits_and_unlabelled_test(hub):
    fake = hub({("nyu-mll/glue", "mnli", "validation_matched"): [
                   {"premise": "A man sleeps.", "hypothesis": "A man is awake.", "label": 2, "idx": 0}],
                ("nyu-mll/glue", "mnli", "test_matched"): [
                   {"premise": "P", "hypothesis": "H", "label": -1, "idx": 0}]})
    (dev,) = load_split("mnli", "validation")
    assert (dev["text"], dev["text_pair"], dev["label"], dev["label_name"]) == (
        "A man sleeps.", "A man is awake.", 2, "contradiction")
    assert dev["premise"] == "A man sleeps."  # original columns kept
    assert load_split("mnli", "test")[0]["label"] is None
    assert {c["config"] for c in fake.calls} == {"mnli"}


def test_atis_hub_holds_out_exactly_500_and_normalises_intents(hub):
    rows = [{"id": i, "intent": "flight+airfare" if i == 0 else "flight", "text": f"w{i} to boston",
             "slots": "O O B-toloc.city_name"} for i in range(620)]
    hub({("tuetschek/atis", None, "train"): rows})
    train, validation = load_split("atis", "train", split_seed=1), load_split("atis", "validation", split_seed=1)
    assert (len(train), len(validation)) == (120, 500)
    assert not {r["hub_index"] for r in train} & {r["hub_index"] for r in validation}
    intents = {r["hub_index"]: r["intent"] for r in train + validation}
    assert intents[0] == "atis_flight#atis_airfare" and intents[1] == "atis_flight"
    assert validation == load_split("atis", "validation", split_seed=1)


def test_snips_hub_drops_misaligned_rows_and_halves_test(hub):
    train = [{"input": "play jazz", "intent": "PlayMusic", "slots": "O B-genre"},
             {"input": "play some jazz", "intent": "PlayMusic", "slots": "O B-genre"}]
    test = [{"input": f"rate book {i}", "intent": "RateBook", "slots": "O B-object_type O"} for i in range(10)]
    hub({("bkonkle/snips-joint-intent", None, "train"): train, ("bkonkle/snips-joint-intent", None, "test"): test})
    with pytest.warns(UserWarning, match="dropped 1 rows"):
        records = load_split("snips", "train")
    assert records == [{"tokens": ["play", "jazz"], "tags": ["O", "B-genre"], "intent": "PlayMusic", "hub_index": 0}]
    validation, held_out_test = load_split("snips", "validation"), load_split("snips", "test")
    assert len(validation) == len(held_out_test) == 5
    assert {r["hub_index"] for r in validation} | {r["hub_index"] for r in held_out_test} == set(range(10))


def test_yelp_ratings_and_personachat_responses(hub):
    hub({("Yelp/yelp_review_full", None, "train"): [{"label": 4, "text": "Great tacos."}],
         ("AlekseyKorshuk/persona-chat", None, "validation"): [
             {"personality": ["i like dogs ."],
              "utterances": [{"candidates": ["wrong", "hi , i like dogs"], "history": ["hello"]},
                             {"candidates": ["nope", "yes , two"],
                              "history": ["hello", "hi , i like dogs", "pets ?"]}]}]})
    assert load_split("yelp", "train") == [{"text": "Great tacos.", "rating": 5, "label": 4, "id": "0"}]
    responses = load_split("personachat", "test")  # ConvAI2's test is hidden: the official validation split
    assert [r["response"] for r in responses] == ["hi , i like dogs", "yes , two"]
    assert responses[1]["history"] == ["hello", "hi , i like dogs", "pets ?"]
    assert responses[0]["persona"] == ["i like dogs ."] and responses[0]["dialog_id"] == "validation-0"


def test_hub_failure_is_one_sentence_naming_the_fix(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(UserError) as caught:
        load_split("qqp", "train")
    message = str(caught.value)
    assert "\n" not in message and "nyu-mll/glue (qqp)" in message and "pass data.path=" in message
