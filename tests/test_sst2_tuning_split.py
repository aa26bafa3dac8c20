"""The SST-2 tuning split (benchmarks/sst2_tuning_split.py) is a seeded partition of the training rows."""

import importlib.util
from pathlib import Path

import pytest

from dptext.data.glue import read_sst2

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sst2_tuning_split", ROOT / "benchmarks" / "sst2_tuning_split.py")
split = importlib.util.module_from_spec(spec)
spec.loader.exec_module(split)


def test_split_is_a_seeded_partition_in_original_order():
    rows = [f"sentence {i}\t{i % 2}\n" for i in range(50)]
    train, held = split.split_rows(rows, 10, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert sorted(train + held, key=rows.index) == rows  # every row once, none invented
    assert train == sorted(train, key=rows.index) and held == sorted(held, key=rows.index)
    assert split.split_rows(rows, 10, seed=3) == (train, held)
    assert split.split_rows(rows, 10, seed=4) != (train, held)
    with pytest.raises(ValueError, match="cannot hold out"):
        split.split_rows(rows, 50, seed=0)


def test_written_folder_reads_as_sst2(tmp_path):
    source = tmp_path / "sst2"
    source.mkdir()
    (source / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"w{i} good\t{i % 2}\n" for i in range(30)))
    out = tmp_path / "tuning"
    assert split.main([str(source), str(out), "--held-out", "5"]) == 0
    train, validation = read_sst2("train", str(out)), read_sst2("validation", str(out))
    assert len(train) == 25 and len(validation) == 5
    assert {r["text"] for r in train}.isdisjoint(r["text"] for r in validation)
    assert sorted(r["label"] for r in train + validation) == sorted(i % 2 for i in range(30))
    assert not list(out.glob(".*partial"))
