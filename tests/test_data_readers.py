"""Every local reader against ../shared/data and the installed packages: the row counts and
example rows documented in each SOURCE.md, read through the public ``load_split``."""

from __future__ import annotations

import functools
import json
from collections import Counter

import pytest

from dptext.data import group_references, load_split


@functools.lru_cache(maxsize=None)
def read(dataset: str, split: str, path: str | None) -> list[dict]:
    """Each file is parsed once per test; tests must not mutate the returned records."""
    return load_split(dataset, split, path)


@pytest.fixture(autouse=True)
def _forget_records():
    """Drop each test's records afterwards: hundreds of thousands of live dicts slow every later GC pass."""
    yield
    read.cache_clear()


def counts(dataset: str, path) -> tuple[int, ...]:
    return tuple(len(read(dataset, s, None if path is None else str(path))) for s in ("train", "validation", "test"))


def test_e2e_counts_references_and_quoted_newlines(shared_data):
    folder = shared_data / "e2e_nlg"
    assert counts("e2e", folder) == (42_061, 4_672, 4_693)
    train, dev, test = (read("e2e", s, str(folder)) for s in ("train", "validation", "test"))
    assert [len({r["mr"] for r in split}) for split in (train, dev, test)] == [4_862, 547, 630]
    assert train[0] == {
        "mr": "name[The Vaults], eatType[pub], priceRange[more than £30], customer rating[5 out of 5], "
              "near[Café Adriatic]",
        "ref": "The Vaults pub near Café Adriatic has a 5 star rating.  Prices start at £30.",
    }
    assert train[1]["ref"].startswith("Close to Café Brazil, The Cambridge Blue pub serves delicious Tuscan Beef")
    # Data rows 15,765 and 32,410 hold a newline inside a quoted reference: still one record each.
    multiline = [i + 1 for i, r in enumerate(train) if "\n" in r["ref"] or "\r" in r["ref"]]
    assert multiline == [15_765, 32_410]
    assert all("\n" not in r["mr"] for r in train)
    # The quoted header of testset_w_refs.csv is a header, not a record.
    assert test[0] == {"mr": "name[Blue Spice], eatType[coffee shop], area[city centre]",
                       "ref": "A coffee shop in the city centre area called Blue Spice."}
    grouped = group_references(test)
    assert len(grouped) == 630 and sum(len(g["refs"]) for g in grouped) == 4_693
    assert grouped[0]["input"] == test[0]["mr"] and test[1]["ref"] in grouped[0]["refs"]


def test_dart_dev_and_test_counts_sources_and_grouping(shared_data):
    folder = str(shared_data / "dart")
    dev, test = read("dart", "validation", folder), read("dart", "test", folder)
    assert (len(dev), len(test)) == (6_980, 12_552)
    assert len(group_references(dev)) == 2_768 and len(group_references(test)) == 5_097
    assert Counter(r["source"] for r in dev) == {"e2e": 4_290, "webnlg": 2_268, "WikiSQL_decl_sents": 250,
                                                "WikiTableQuestions_lily": 106, "WikiTableQuestions_mturk": 39,
                                                "WikiSQL_lily": 27}
    assert Counter(r["source"] for r in test)["webnlg"] == 7_361
    assert dev[0] == {"tripleset": [["Mars Hill College", "JOINED", "1973"],
                                    ["Mars Hill College", "LOCATION", "Mars Hill, North Carolina"]],
                      "ref": "A school from Mars Hill, North Carolina, joined in 1973.",
                      "source": "WikiSQL_decl_sents", "entry": 0}
    assert test[0]["tripleset"] == [["Hawaii Five-O", "NOTES", "Episode: The Flight of the Jewels"],
                                    ["[TABLECONTEXT]", "[TITLE]", "Jeff Daniels"],
                                    ["[TABLECONTEXT]", "TITLE", "Hawaii Five-O"]]
    assert test[0]["ref"] == "Jeff Daniels played in the Hawaii Five-O episode The Flight of the Jewels"


def test_dart_xml_and_json_readers_agree_record_by_record(shared_data):
    from dptext.data.dart import read_dart_json, read_dart_xml

    folder = shared_data / "dart"
    assert read_dart_xml(folder / "dart-v1.1.1-full-dev.xml") == read_dart_json(folder / "dart-v1.1.1-full-dev.json")


def test_sst2_counts_labels_and_unlabelled_test(shared_data):
    folder = str(shared_data / "sst2")
    assert counts("sst2", folder) == (67_349, 872, 1_821)
    train, dev, test = (read("sst2", s, folder) for s in ("train", "validation", "test"))
    assert Counter(r["label"] for r in train) == {1: 37_569, 0: 29_780}
    assert Counter(r["label"] for r in dev) == {1: 444, 0: 428}
    assert train[0]["text"] == "hide new secretions from the parental units"
    assert train[0]["sentence"] == "hide new secretions from the parental units "  # original column kept
    assert (train[0]["label"], train[0]["label_name"], train[0]["text_pair"]) == (0, "negative", None)
    assert (dev[0]["text"], dev[0]["label_name"]) == ("it 's a charming and often affecting journey .", "positive")
    assert all(r["label"] is None and r["label_name"] is None for r in test)
    assert test[0]["index"] == "0" and test[0]["text"] == "uneasy mishmash of styles and genres ."


def test_atis_counts_examples_and_label_inventory(shared_data):
    folder = str(shared_data / "atis")
    assert counts("atis", folder) == (4_478, 500, 893)
    train, dev, test = (read("atis", s, folder) for s in ("train", "validation", "test"))
    assert train[0] == {
        "tokens": "i want to fly from baltimore to dallas round trip".split(),
        "tags": "O O O O O B-fromloc.city_name O B-toloc.city_name B-round_trip I-round_trip".split(),
        "intent": "atis_flight",
    }
    assert dev[0]["tokens"][-3:] == ["in", "the", "morning"] and dev[0]["tags"][-1] == "B-arrive_time.period_of_day"
    everything = train + dev + test
    assert len({r["intent"] for r in everything}) == 26 and len({r["intent"] for r in train}) == 21
    assert len({t for r in everything for t in r["tags"]}) == 127 and len({t for r in train for t in r["tags"]}) == 120
    assert all(len(r["tokens"]) == len(r["tags"]) for r in everything)


def test_snips_counts_and_trailing_spaces(shared_data):
    folder = str(shared_data / "snips")
    assert counts("snips", folder) == (13_084, 700, 700)
    train = read("snips", "train", folder)
    assert train[1] == {"tokens": "add step to me to the 50 clásicos playlist".split(),
                        "tags": "O B-entity_name I-entity_name I-entity_name O O B-playlist I-playlist O".split(),
                        "intent": "AddToPlaylist"}
    assert len({r["intent"] for r in train}) == 7
    assert len({t for r in train for t in r["tags"]}) == 72
    assert all(t for r in train for t in r["tokens"] + r["tags"])  # no empty token from a trailing space


def test_amazon_counts_ratings_per_category_and_no_reviewer_fields(shared_data):
    folder = str(shared_data / "amazon_multidomain_sentiment")
    splits = [read("amazon", s, folder) for s in ("train", "validation", "test")]
    assert [len(s) for s in splits] == [6_400, 800, 800]
    everything = [r for s in splits for r in s]
    ratings = Counter((r["category"], r["rating"]) for r in everything)
    expected = {"books": (538, 462, 269, 731), "dvd": (530, 470, 286, 714),
                "electronics": (666, 334, 320, 680), "kitchen & housewares": (687, 313, 246, 754)}
    for category, (one, two, four, five) in expected.items():
        assert [ratings[(category, stars)] for stars in (1, 2, 4, 5)] == [one, two, four, five], category
    assert all(r["label"] == (r["rating"] >= 4) for r in everything)
    first = next(r for r in everything if r["id"] == "books/negative.review/1")
    assert first["title"] == "Horrible book, horrible." and first["rating"] == 1 and first["label"] == 0
    assert first["text"].startswith("THis book was horrible.  If it was possible to rate it lower than one star")
    assert set(first) == {"text", "title", "category", "rating", "label", "id"}  # reviewer/location never read
    assert not any("&amp;" in r["text"] or "&amp;" in r["title"] for r in everything)


def test_imdb_from_the_downloaded_wheel():
    splits = [read("imdb", s, None) for s in ("train", "validation", "test")]
    assert [len(s) for s in splits] == [40_000, 5_000, 5_000]
    everything = [r for s in splits for r in s]
    assert Counter(r["label"] for r in everything) == {0: 25_000, 1: 25_000}
    first = next(r for r in everything if r["id"] == "0")
    assert first["text"].startswith("One of the other reviewers has mentioned that after watching just 1 Oz episode")
    assert first["label"] == 1


def test_chitchat_one_record_per_response_split_by_dialog():
    splits = [read("chitchat", s, None) for s in ("train", "validation", "test")]
    assert sum(len(s) for s in splits) == 131_569  # 138,737 messages minus one opening message per dialog
    dialogs = [{r["dialog_id"] for r in s} for s in splits]
    assert [len(d) for d in dialogs] == [3_214, 402, 402]  # the 4,018 dialogs with at least one response
    assert not (dialogs[0] & dialogs[1] or dialogs[0] & dialogs[2] or dialogs[1] & dialogs[2])
    everything = [r for s in splits for r in s]
    opening = [r for r in everything if r["dialog_id"] == "a07edb12-6b91-4138-b11e-02421888d699"]
    assert opening[0]["history"] == ["Hello How are you doing today?"]
    assert opening[0]["response"] == "whats up MD im doing good how are you doing?"
    assert opening[1]["history"] == [opening[0]["history"][0], opening[0]["response"]]


def test_bbc_news_from_the_installed_package():
    splits = [read("news", s, None) for s in ("train", "validation", "test")]
    everything = [r for s in splits for r in s]
    assert len(everything) == 2_225
    assert Counter(r["topic"] for r in everything) == {"business": 510, "entertainment": 386, "politics": 417,
                                                       "sport": 511, "tech": 401}
    first = next(r for r in everything if r["id"] == "business/001")
    assert first["title"] == "Ad sales boost Time Warner profit" and first["label"] == 0
    assert "£" in next(r for r in everything if r["id"] == "sport/199")["text"]  # the one Latin-1 article


def test_records_are_plain_json_values(shared_data):
    for dataset, folder in (("e2e", "e2e_nlg"), ("dart", "dart"), ("sst2", "sst2"), ("atis", "atis")):
        json.dumps(read(dataset, "validation", str(shared_data / folder))[:5])


def test_glue_pair_tasks_read_columns_from_their_headers(tmp_path):
    """QNLI, MNLI and QQP are not in ../shared/data: small files in GLUE's exact layouts."""
    layouts = {
        "qnli": ("train.tsv", "index\tquestion\tsentence\tlabel\n0\tWho wrote it?\tShe wrote \"it\".\tentailment\n"),
        "mnli": ("dev_matched.tsv", "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n"
                                    "0\t1\t1e\tfiction\tA \"man\" sleeps.\tA man is awake.\tneutral\tcontradiction\n"),
        "qqp": ("test.tsv", "id\tquestion1\tquestion2\n0\tHow do I cook rice?\tHow to cook rice?\n"),
    }
    expected = {"qnli": ("Who wrote it?", 'She wrote "it".', 0, "entailment"),
                "mnli": ('A "man" sleeps.', "A man is awake.", 2, "contradiction"),
                "qqp": ("How do I cook rice?", "How to cook rice?", None, None)}
    split_of = {"train.tsv": "train", "dev_matched.tsv": "validation", "test.tsv": "test"}
    for task, (name, text) in layouts.items():
        folder = tmp_path / task
        folder.mkdir()
        (folder / name).write_text(text)
        (record,) = load_split(task, split_of[name], folder)
        assert (record["text"], record["text_pair"], record["label"], record["label_name"]) == expected[task]
    assert load_split("mnli", "validation", tmp_path / "mnli")[0]["genre"] == "fiction"


@pytest.mark.parametrize("content, says", [("", "is empty"), ("text,label\nfine,1\n", "expected review and sentiment")])
def test_imdb_file_that_is_not_the_imdb_csv_is_refused_in_one_sentence(tmp_path, content, says):
    from dptext.data.reviews import read_imdb_all
    from dptext.errors import UserError

    path = tmp_path / "reviews.csv"
    path.write_text(content)
    with pytest.raises(UserError, match=says):
        read_imdb_all(str(path))
