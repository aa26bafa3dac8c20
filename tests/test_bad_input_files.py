"""Issue 46, odd files: recipes and data in other encodings or compressed, unreadable files, model paths that are
not model folders, `~` and relative data paths. Each is one sentence naming the file and what it is."""

from __future__ import annotations

import gzip
import os
import pathlib

import pytest

from dptext import config
from dptext.errors import UserError
from dptext.model_check import check_model_name
from test_bad_input_cases import QUICKSTART, TINY, own_data, refused

CSV_TINY = [t for t in TINY if not t.startswith("task.labels")] + ["task.labels=[negative,positive]",
                                                                   "data.label_column=label"]


def csv_file(folder, text: str, name="reviews.csv") -> pathlib.Path:
    path = folder / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def rows(n=24):
    return "".join(f"review {i} was {'good' if i % 2 else 'bad'},{i % 2}\n" for i in range(n))


def check(data, capsys, *fragments):
    return refused(["check", str(QUICKSTART), *CSV_TINY, f"data.path={data}"], capsys, *fragments)


# --------------------------------------------------------------------------- recipes

def test_a_latin1_byte_in_a_recipe_comment_names_line_and_byte(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"name: r\n# caf\xe9 reviews\nmodel:\n  name: tiny-bert\n")
    line = refused(["check", str(recipe)], capsys, "not UTF-8", "byte 0xE9 at line 2, column 6", "iconv")
    assert str(recipe) in line


def test_a_utf16_recipe_and_a_folder_as_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel:\n  name: tiny-bert\n", encoding="utf-16")
    refused(["check", str(recipe)], capsys, "UTF-16", "save it as UTF-8")
    refused(["check", str(tmp_path)], capsys, "is a folder")


def test_an_unreadable_recipe(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")

    def denied(self):  # the tests run as root, for whom chmod 000 denies nothing
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    refused(["check", str(recipe)], capsys, "cannot be read (permission denied)")


# --------------------------------------------------------------------------- data files

def test_a_latin1_character_in_a_csv_names_the_line(tmp_path, capsys):
    data = csv_file(tmp_path, b"text,label\n" + rows(3).encode() + b"caf\xe9 was good,1\n" + rows(20).encode())
    check(data, capsys, "not UTF-8", "byte 0xE9 at line 5", str(data))


def test_gzip_bytes_named_csv_and_an_unreadable_csv(tmp_path, capsys, monkeypatch):
    data = csv_file(tmp_path, gzip.compress(("text,label\n" + rows()).encode()))
    check(data, capsys, "gzip-compressed", "gunzip")
    from test_bad_input_fuzz import zipped

    check(csv_file(tmp_path, zipped(("text,label\n" + rows()).encode()), name="zipped.csv"), capsys, "a zip archive")
    folder_named_csv = tmp_path / "folder.csv"
    folder_named_csv.mkdir()
    with pytest.raises(UserError, match="cannot be read"):
        from dptext.data.generic import read_table_file

        read_table_file(folder_named_csv)
    plain = csv_file(tmp_path, "text,label\n" + rows(), name="plain.csv")
    real_open = open

    def denied(path, *args, **kwargs):
        if str(path) == str(plain):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)
    check(plain, capsys, "cannot be read (permission denied)")


def test_a_csv_cut_short_inside_a_quote_or_past_csvs_field_limit_names_the_row(tmp_path, capsys):
    """A file cut short inside a quoted field made its last row a record without a label (accepted: n one too
    many); a quote that never closes in a large file hit csv's field limit (an 'unexpected Error'); a NUL byte
    went into a record's text (a recipe or jsonl file with one is refused)."""
    text = "text,label\n" + rows(23) + '"review 23, cut short'
    check(csv_file(tmp_path, text), capsys, "row 25 has fewer fields than the header's 2 columns", "cut short")
    check(csv_file(tmp_path, 'text,label\n"' + "x" * 140_000 + "\n"), capsys, "not readable as CSV",
          "field limit", "quoting")
    check(csv_file(tmp_path, "text,label\n" + rows(3) + "caf\x00e was good,1\n" + rows(20)), capsys,
          "row 5 holds a NUL byte")


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path, capsys):
    data = csv_file(tmp_path, "text,label,text\n" + "".join(f"a{i},{i % 2},b{i}\n" for i in range(24)))
    check(data, capsys, "'text'", "more than once")


def test_a_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    from dptext.data.generic import read_table_file

    data = csv_file(tmp_path, "\ufefftext,label\nfine,1\n")
    assert read_table_file(data, label_column="label")[0]["text"] == "fine"


def test_a_tilde_in_data_path_is_expanded_and_a_relative_one_is_explained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    data = own_data(tmp_path)
    recipe = config.load_recipe(None, ["data.path=~/reviews.jsonl"])
    assert recipe.data.path == str(data) and recipe.data.dataset == "jsonl"
    monkeypatch.chdir(tmp_path)
    line = refused(["check", str(QUICKSTART), "data.dataset=jsonl", "data.path=no/such.jsonl"], capsys,
                   "no/such.jsonl", "resolves against the working directory")
    assert str(tmp_path) in line


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("kind, fragment", [("gguf", "GGUF file"), ("csv", "csv data file"),
                                            ("loop", "leads nowhere"), ("file", "a file, not a model folder")])
def test_a_path_that_is_no_model_folder_says_what_it_is(tmp_path, kind, fragment):
    path = tmp_path / {"gguf": "m.Q4.gguf", "csv": "reviews.csv", "loop": "loop", "file": "weights.bin"}[kind]
    if kind == "loop":
        os.symlink(path, path)
    else:
        path.write_bytes(b"GGUF" if kind == "gguf" else b"x")
    with pytest.raises(UserError, match=fragment) as error:
        check_model_name(str(path))
    assert "does not exist" not in str(error.value)


def test_a_folder_without_config_and_a_tilde_model_path(tmp_path, capsys, monkeypatch):
    refused(["check", str(QUICKSTART), f"model.name={tmp_path}"], capsys, "holds no config.json")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    check_model_name("~/m")  # expanded like a shell would, not looked up on the hub


def test_a_truncated_safetensors_model_folder(tmp_path, capsys):
    from dptext.models import load_model

    model, tokenizer = load_model("tiny-gpt2")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match="weights file is damaged or incomplete"):
        load_model(str(folder))
    refused(["models", "--check", str(folder)], capsys, "damaged or incomplete")
