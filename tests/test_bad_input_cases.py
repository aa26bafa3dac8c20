"""The fourteen bad-input cases of issue 20, one test each: one sentence and exit 2, or what a user expects.

Cases whose fix is a declared schema range (3 lr, 7 max_steps, 13 ε/δ/C) are also walked by
tests/test_bad_input_fuzz.py; here each is run as the issue describes it.
"""

from __future__ import annotations

import json
import time

import pytest

from dptext import config
from dptext.cli.app import main
from dptext.errors import UserError
from dptext.output import Progress

TINY = ["model.name=tiny-bert", "data.dataset=null", "data.max_train_examples=null", "data.max_eval_examples=8",
        "task.type=classification", "data.max_length=32", "train.batch_size=8",
        "train.max_steps=2", "eval.split=validation", "eval.batch_size=8", "name=own",
        "task.labels=[negative,positive]"]


def own_data(folder, labels=None, texts=None):
    """A tiny jsonl training file of the user's own (text, label) records."""
    labels = labels if labels is not None else [i % 2 for i in range(24)]
    texts = texts if texts is not None else [f"review number {i} was {'good' if i % 2 else 'bad'}"
                                             for i in range(len(labels))]
    path = folder / "reviews.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(texts, labels)))
    return path


def cli(args, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(args)
    err = capsys.readouterr().err
    return code.value.code, err


def refused(args, capsys, *fragments):
    code, err = cli(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


def finetune(tmp_path, *extra, out="run"):
    data = own_data(tmp_path) if not any(e.startswith("data.path=") for e in extra) else None
    args = ["finetune", str(QUICKSTART)] + TINY + ([f"data.path={data}"] if data else []) + list(extra)
    return args + ["--out", str(tmp_path / out)]


QUICKSTART = __import__("pathlib").Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def test_1_a_failed_start_leaves_nothing_and_a_rerun_may_reuse_the_folder(tmp_path, capsys):
    refused(finetune(tmp_path, "train.learning_rate=-1"), capsys, "train.learning_rate")
    assert not (tmp_path / "run").exists()
    # a start that fails after the run directory was created (a class id the data cannot have) removes it too
    own_data(tmp_path, labels=[0, 1] * 11 + [-3, 1])
    refused(finetune(tmp_path, f"data.path={tmp_path / 'reviews.jsonl'}"), capsys, "record", "label outside",
            "task.labels")
    assert not (tmp_path / "run").exists()


def test_2_bench_memory_refuses_an_unknown_model_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    refused(["bench-memory", "no-such-model-xyz", "--out", str(tmp_path / "bench")], capsys, "no-such-model-xyz",
            "tiny-gpt2")
    assert time.monotonic() - started < 10 and list(tmp_path.iterdir()) == []


def test_3_negative_learning_rate(tmp_path, capsys):
    refused(finetune(tmp_path, "train.learning_rate=-1"), capsys, "'train.learning_rate'", "> 0")


def test_4_unwritable_out(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    refused(finetune(tmp_path, out="a-file/run"), capsys, "a-file", "--out")
    refused(finetune(tmp_path, out="a-file"), capsys, "is a file")


def test_5_a_jsonl_path_without_dataset_uses_the_jsonl_reader(tmp_path, capsys):
    data = own_data(tmp_path)
    recipe = config.load_recipe(None, [f"data.path={data}"])
    assert recipe.data.dataset == "jsonl"
    assert config.load_recipe(None, [f"data.path={tmp_path / 'x.csv'}"]).data.dataset == "csv"
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "a.parquet").write_text("")
    with pytest.raises(UserError, match="set data.dataset"):
        config.load_recipe(None, [f"data.path={tmp_path / 'odd'}"])
    code, _ = cli(["check", str(QUICKSTART), "model.name=tiny-bert", "data.dataset=null", f"data.path={data}",
                   "task.labels=[negative,positive]", "train.batch_size=8"], capsys)  # own data: declared classes
    assert code == 0


def test_6_sigma_and_target_epsilon_together(tmp_path, capsys):
    refused(finetune(tmp_path, "privacy.noise_multiplier=1.0", "privacy.target_epsilon=3"), capsys,
            "privacy.noise_multiplier", "privacy.target_epsilon")


def test_7_zero_max_steps(tmp_path, capsys):
    refused(finetune(tmp_path, "train.max_steps=0"), capsys, "'train.max_steps'")


def test_8_eta_after_resume_counts_only_the_remaining_steps(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    lines = []
    monkeypatch.setattr("builtins.print", lambda line, **_: lines.append(line))
    progress = Progress(None, total=1000, description="training", start=120)
    clock[0] += 10.0
    progress.advance(20)  # 2 steps/s since the resume, 860 left: 430 s, not 860 * 10 / 140
    assert progress.done == 140
    assert "eta 430s" in lines[-1]


def test_9_nan_clipping_norm_is_refused_and_a_diverging_run_stops(tmp_path, capsys):
    refused(finetune(tmp_path, "privacy.max_grad_norm=nan"), capsys, "'privacy.max_grad_norm'", "finite")
    code, err = cli(finetune(tmp_path, "train.optimizer=sgd", "train.learning_rate=1e38", "privacy.enabled=false",
                             "train.max_steps=6", "train.checkpoint_every=1"), capsys)
    assert code == 2 and "NaN or infinite" in err and "lower train.learning_rate" in err
    assert not (tmp_path / "run" / "result.json").exists()  # never a success summary


def test_10_synth_chunks_and_audit_files_with_unicode_line_separators(tmp_path):
    from dptext.attacks.audit_records import read_records
    from dptext.data.audit_split import AUDIT_DIR
    from dptext.distill.chunked_generation import CHUNKS, read_chunks
    from dptext.runs import read_lines

    odd = ["next\u0085line", "para\u2028graph", "sep\u2029arated", "form\x0cfeed"]
    (tmp_path / CHUNKS).mkdir()
    (tmp_path / CHUNKS / "part-00000.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in odd), encoding="utf-8")
    assert [r["text"] for r in read_chunks(tmp_path)] == odd
    (tmp_path / "resolved.yaml").write_text("name: x\n")
    (tmp_path / AUDIT_DIR).mkdir()
    (tmp_path / AUDIT_DIR / "members.jsonl").write_text(
        "".join(json.dumps({"index": i, "record": {"text": t}}, ensure_ascii=False) + "\n" for i, t in enumerate(odd)),
        encoding="utf-8")
    assert [r["record"]["text"] for r in read_records(tmp_path, "members")] == odd
    assert len(read_lines(tmp_path / AUDIT_DIR / "members.jsonl")) == len(odd)


def test_11_stray_negative_and_empty_labels_and_zero_length(tmp_path, capsys):
    data = own_data(tmp_path, labels=[0, 1] * 11 + [7, 0])
    line = refused(["check", str(QUICKSTART), *TINY, f"data.path={data}"], capsys, "record",
                   "label outside the declared set (task.labels)", "dptext data --split")
    shown = line.replace(str(tmp_path), "")  # the temporary folder's name may hold any digit
    assert "review number" not in shown and "7" not in shown  # the record's text and label stay private
    data = own_data(tmp_path, labels=[0, 1] * 12, texts=[" "] * 24)
    refused(["check", str(QUICKSTART), *TINY, f"data.path={data}"], capsys, "empty")
    refused(finetune(tmp_path, "data.max_length=0"), capsys, "'data.max_length'")


def test_12_an_unknown_model_offline_fails_in_about_a_second(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    refused(finetune(tmp_path, "model.name=nosuch-org/nosuch-model"), capsys, "nosuch-org/nosuch-model",
            "offline", "tiny-gpt2")
    assert time.monotonic() - started < 5 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [("privacy.target_epsilon=0", "privacy.target_epsilon"),
                                           ("privacy.delta=1", "privacy.delta"),
                                           ("train.learning_rate=-1", "train.learning_rate"),
                                           ("privacy.max_grad_norm=0", "privacy.max_grad_norm"),
                                           ("data.path=/no/such/folder", "data.path")])
def test_13_check_refuses_what_finetune_would(override, key, capsys):
    refused(["check", str(QUICKSTART), override], capsys, key)


def test_13_a_degenerate_sigma_is_refused_before_training(capsys):
    """σ = 1e-9 trained and then crashed writing the ledger (issue 43); now one sentence before anything runs."""
    refused(["check", str(QUICKSTART), "privacy.target_epsilon=null", "privacy.noise_multiplier=1e-9"], capsys,
            "privacy.noise_multiplier")


@pytest.mark.parametrize("method", ["dp_sgd", "edp_sgd"])
def test_13_finetune_refuses_a_degenerate_sigma_before_writing_a_run(method, tmp_path, capsys):
    """Through `dptext finetune`, for DP-SGD and eDP-SGD (whose privacy.noise_multiplier is z_0) alike."""
    refused(finetune(tmp_path, "privacy.target_epsilon=null", "privacy.noise_multiplier=1e-9",
                     f"privacy.method={method}"), capsys, "privacy.noise_multiplier", "0.03")
    assert not (tmp_path / "run").exists()


def test_13_account_answers_a_tiny_sigma_in_seconds(capsys):
    """`dptext account --sigma 0.001 -q 1 --steps 30 --delta 0.01` died with MemoryError (224 GiB, issue 43)."""
    started = time.monotonic()
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["account", "--sigma", "0.001", "-q", "1", "--steps", "30", "--delta", "0.01", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code.value.code == 0 and time.monotonic() - started < 10
    results = {row["method"]: row for row in shown["results"]}
    assert results["rdp"]["epsilon"] > 1e6 and results["pld"]["epsilon"] is None and results["pld"]["note"]


def test_13_check_is_fast_and_accepts_a_good_recipe(capsys):
    started = time.monotonic()
    code, err = cli(["check", str(QUICKSTART)], capsys)
    assert code == 0 and time.monotonic() - started < 30, err  # reads IMDB's 25,000 training reviews


def test_11_dptext_data_shows_labels_lengths_and_empty_texts(tmp_path, capsys):
    data = own_data(tmp_path, labels=[0, 1, 7] * 8, texts=["", "two words", "three more words"] * 8)
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["data", "jsonl", "--path", str(data), "--split", "train", "--json"])
    shown = json.loads(capsys.readouterr().out)["statistics"]["train"]
    assert code.value.code == 0 and set(shown["labels"]) == {"0", "1", "7"}
    assert shown["empty_texts"] == shown["labels"]["0"]  # the empty texts are exactly the class-0 records
    from dptext.data.summary import split_statistics

    stats = split_statistics([{"text": "", "label": 0}, {"text": "two words", "label": 1},
                              {"text": "a b c", "label": 7}, {"text": "  ", "label": 7}])
    assert stats["empty_texts"] == 2 and stats["words"] == {"min": 0, "median": 1.0, "max": 3}
    assert stats["labels"] == {"7": 2, "0": 1, "1": 1}
