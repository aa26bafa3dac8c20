"""Property-based walk over the recipe schema and the CLI: every bad input ends the same way.

For every key `dptext check --schema` lists, values of the wrong type, out of the declared range, non-finite,
empty, and the declared contradictory pairs are passed as overrides to the real `dptext finetune`; for every
subcommand, missing and unknown arguments. Each must exit with code 2 and print one line on stderr that names
the key (or option) and what to do, with no traceback and no new file or directory. The keys, ranges and
alternatives come from the schema itself, so a key added later is fuzzed without editing this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dptext import config
from dptext.cli.app import main

EXAMPLES_PER_KEY = 3  # bounded for CI: ~80 keys x 2 kinds x this in-process CLI calls (~1 min on 2 cores)
QUICKSTART = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml")
BASE = [QUICKSTART, "model.name=tiny-gpt2", "data.dataset=imdb", "task.type=classification", "train.max_steps=1"]


def leaves():
    """(dotted key, field, type) of every leaf of the schema."""
    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], prefix + f.name + ".")
            else:
                yield prefix + f.name, f, hints[f.name]
    return list(walk(config.Recipe, ""))


LEAVES = leaves()


def inner_type(tp):
    optional, inner = config._is_optional(tp)
    return optional, inner


def run_cli(args: list[str]) -> tuple[int, str, list[str]]:
    """Run dptext in a fresh working directory: (exit code, stderr, files and folders it left there)."""
    with tempfile.TemporaryDirectory() as cwd:
        before = os.getcwd()
        os.chdir(cwd)
        stdout, stderr = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    main(args)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.chdir(before)
        left = sorted(str(p.relative_to(cwd)) for p in Path(cwd).rglob("*"))
    return code, stderr.getvalue(), left


def assert_refused(args: list[str], names: str) -> None:
    code, err, left = run_cli(args)
    lines = err.strip().splitlines()
    assert code == 2, (args, code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)
    assert "Traceback" not in err and names in lines[0], (args, err)
    assert left == [], (args, left)


def finetune(override: str) -> list[str]:
    return ["finetune", *BASE, override, "--out", "run"]


def wrong_type(tp) -> st.SearchStrategy[str]:
    """YAML text whose value is never of type ``tp`` (nor empty)."""
    _, inner = inner_type(tp)
    word = st.from_regex(r"x[a-z]{2,7}", fullmatch=True)  # never a YAML number, bool or null
    mapping = st.just("{a: 1}")
    if inner in (int, float):
        return st.one_of(word, mapping, st.just("[1, 2]"), st.sampled_from(["true", "false"]))
    if inner is bool:
        return st.one_of(word, mapping, st.integers(2, 99).map(str))
    if inner is str:
        return st.one_of(mapping, st.just("[a, b]"), st.sampled_from(["true", "false"]))
    if inner is list or typing.get_origin(inner) is list:
        return st.one_of(word, mapping, st.integers().map(str))
    return st.one_of(word.filter(lambda w: w not in typing.get_args(inner)), st.integers().map(str), mapping)


def out_of_range(field, tp) -> st.SearchStrategy[str] | None:
    _, inner = inner_type(tp)
    ge, gt, le, lt = field.metadata.get("bounds", (None,) * 4)
    if inner not in (int, float) or all(b is None for b in (ge, gt, le, lt)):
        return None
    delta = st.integers(1, 10**6) if inner is int else st.floats(1e-3, 1e6)
    options = []
    if ge is not None:
        options.append(delta.map(lambda d: ge - d))
    if gt is not None:
        options.append(st.one_of(st.just(gt), delta.map(lambda d: gt - d)))
    if le is not None:
        options.append(delta.map(lambda d: le + d))
    if lt is not None:
        options.append(st.one_of(st.just(lt), delta.map(lambda d: lt + d)))
    values = st.one_of(*options).map(lambda v: repr(int(v) if inner is int else float(v)))
    if inner is float:
        values = st.one_of(values, st.sampled_from([".nan", "nan", ".inf", "-.inf", "inf"]))
    return values


KEYS = [key for key, _, _ in LEAVES]


@pytest.mark.parametrize("key, field, tp", LEAVES, ids=KEYS)
@settings(max_examples=EXAMPLES_PER_KEY, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_wrong_type_is_refused(key, field, tp, data):
    value = data.draw(wrong_type(tp))
    assert_refused(finetune(f"{key}={value}"), f"'{key}'")


RANGED = [(k, f, t) for k, f, t in LEAVES if out_of_range(f, t) is not None]


@pytest.mark.parametrize("key, field, tp", RANGED, ids=[k for k, _, _ in RANGED])
@settings(max_examples=EXAMPLES_PER_KEY, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_out_of_range_or_non_finite_is_refused(key, field, tp, data):
    value = data.draw(out_of_range(field, tp))
    assert_refused(finetune(f"{key}={value}"), f"'{key}'")


REQUIRED = [(k, f, t) for k, f, t in LEAVES
            if not inner_type(t)[0] and f.default not in ("", None) and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize("key", [k for k, _, _ in REQUIRED])
def test_empty_value_of_a_required_key_is_refused(key):
    assert_refused(finetune(f"{key}="), f"'{key}'")
    assert_refused(finetune(f"{key}=''"), f"'{key}'")


def test_every_numeric_key_declares_its_range():
    unbounded = [k for k, f, t in LEAVES
                 if inner_type(t)[1] in (int, float) and all(b is None for b in f.metadata["bounds"])]
    assert unbounded == []


def contradictions():
    pairs = []
    for key, field, tp in LEAVES:
        other = field.metadata.get("excludes")
        if other:  # both alternatives given: one would be silently ignored
            pairs.append((key, [f"{key}=1.5", f"{other}=3"]))
        needs = field.metadata.get("only_with")
        if needs:  # a non-default value while the key it needs has another value
            _, inner = inner_type(tp)
            value = next(c for c in typing.get_args(inner) if c != field.default) if typing.get_args(inner) else "0.5"
            other_value = "dp_sgd" if needs[1] != "dp_sgd" else "edp_sgd"
            pairs.append((key, [f"{key}={value}", f"{needs[0]}={other_value}"]))
    return pairs


@pytest.mark.parametrize("key, overrides", contradictions(), ids=[k for k, _ in contradictions()])
def test_declared_contradictions_are_refused(key, overrides):
    assert contradictions(), "the schema declares alternatives (σ vs target ε) and dependent keys"
    assert_refused(["finetune", *BASE, *overrides, "--out", "run"], f"'{key}")


def test_an_alternative_left_at_its_default_yields():
    recipe = config.load_recipe(None, ["privacy.noise_multiplier=1.5"])
    assert recipe.privacy.noise_multiplier == 1.5 and recipe.privacy.target_epsilon is None


COMMANDS = ["account", "bench-memory", "check", "data", "decode", "distill", "finetune", "mia", "models", "synth"]


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_option_is_one_line_and_exit_2(command):
    assert_refused([command, "--no-such-option"], "--no-such-option")


@pytest.mark.parametrize("command", ["bench-memory", "data", "decode", "mia", "synth", "account", "check",
                                     "finetune", "distill"])
def test_missing_arguments_are_one_line_and_exit_2(command):
    code, err, left = run_cli([command])
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "--help" in err or "Give" in err or "give" in err, err
    assert left == []


@pytest.mark.parametrize("command", ["finetune", "check", "decode", "bench-memory", "synth", "mia", "data"])
def test_extra_positional_arguments_are_refused(command):
    needs = {"finetune": [QUICKSTART], "check": [QUICKSTART],
             "decode": ["-m", "tiny-gpt2"], "bench-memory": ["tiny-gpt2"], "synth": ["nowhere"],
             "mia": ["nowhere"], "data": ["imdb"]}[command]
    code, err, left = run_cli([command, *needs, "stray=1", "another-stray"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert left == []


# --------------------------------------------------------------------------- odd files (issue 46)
# Recipes and data files as they arrive from other tools: other encodings, a byte order mark, NUL bytes, CRLF, cut
# short, compressed, random bytes, empty. `dptext check` (recipe and data) and `dptext data` must either accept one
# or refuse it in one sentence, exit 2, never a traceback and nothing written.

RECIPE = Path(QUICKSTART).read_bytes()
ROWS = "text,label\n" + "".join(f"\"review {i}, {'good' if i % 2 else 'bad'}\",{i % 2}\n" for i in range(30))
JSONL = "".join(f'{{"text": "review {i} was fine", "label": {i % 2}}}\n' for i in range(30))


def zipped(content: bytes) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("data", content)
    return buffer.getvalue()


def odd_versions(text: str) -> dict[str, bytes]:
    """The same content, damaged or re-encoded the ways that reached us (seeded: the same bytes every run)."""
    utf8 = text.encode("utf-8")
    noise = __import__("random").Random(46)
    return {
        "utf-8": utf8, "latin-1 byte": utf8[:20] + b"caf\xe9 " + utf8[20:],
        "latin-1": text.encode("latin-1", errors="replace"), "utf-16": text.encode("utf-16"),
        "utf-16-le without bom": text.encode("utf-16-le"), "utf-8 bom": b"\xef\xbb\xbf" + utf8,
        "nul bytes": utf8[:30] + b"\x00\x00" + utf8[30:], "crlf": utf8.replace(b"\n", b"\r\n"),
        "cr only": utf8.replace(b"\n", b"\r"), "truncated": utf8[:len(utf8) // 2 + 3],
        "gzip": __import__("gzip").compress(utf8), "zip": zipped(utf8),
        "random bytes": bytes(noise.randrange(256) for _ in range(600)), "empty": b"", "whitespace only": b" \n\t\n",
    }


def assert_accepted_or_one_sentence(args: list[str]) -> None:
    code, err, left = run_cli(args)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and code in (0, 2), (args, code, err)
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)
    assert not [name for name in left if not name.startswith("data.")], (args, left)  # nothing written


def write_in(folder: Path, name: str, content: bytes) -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


CHECK_DATA = ["model.name=tiny-bert", "data.dataset=null", "data.max_train_examples=null", "train.batch_size=4",
              "task.type=classification", "task.labels=[0,1]", "train.max_steps=1", "eval.split=validation"]


@pytest.mark.parametrize("kind", list(odd_versions(RECIPE.decode("utf-8"))))
def test_a_recipe_in_any_encoding_or_damaged_is_accepted_or_one_sentence(kind, tmp_path):
    data = write_in(tmp_path, "data.csv", ROWS.encode("utf-8"))
    recipe = write_in(tmp_path, "recipe.yaml", odd_versions(RECIPE.decode("utf-8"))[kind])
    assert_accepted_or_one_sentence(["check", str(recipe), *CHECK_DATA, f"data.path={data}"])


@pytest.mark.parametrize("suffix, text", [("csv", ROWS), ("jsonl", JSONL)])
@pytest.mark.parametrize("kind", [*odd_versions(""), "header only"])
def test_a_data_file_in_any_encoding_or_damaged_is_accepted_or_one_sentence(kind, suffix, text, tmp_path):
    content = text.splitlines(keepends=True)[0].encode() if kind == "header only" else odd_versions(text)[kind]
    data = write_in(tmp_path, f"data.{suffix}", content)
    assert_accepted_or_one_sentence(["check", QUICKSTART, *CHECK_DATA, f"data.path={data}"])
    assert_accepted_or_one_sentence(["data", suffix, "--path", str(data)])
