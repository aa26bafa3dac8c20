"""Issue 46, inputs that were accepted and wrong or crashed: each is now one sentence and exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from dptext import config, locking, runs
from dptext.errors import UserError
from test_bad_input_cases import finetune, refused


def test_a_recipe_name_cannot_leave_runs(tmp_path, capsys, monkeypatch):
    (tmp_path / "inner").mkdir()
    monkeypatch.chdir(tmp_path / "inner")
    args = [a for a in finetune(tmp_path, "name=../../x") if a not in ("--out", str(tmp_path / "run"))]
    args = [a for a in args if a != "name=own"]
    refused(args, capsys, "'../../x' is not a plain folder name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner", "reviews.jsonl"]
    with pytest.raises(UserError, match="plain folder name"):
        runs.RunDir.create(config.load_recipe(None, ["name=.."]), root=tmp_path / "inner" / "runs")


def test_resume_with_another_out_is_refused(tmp_path, capsys):
    run = runs.RunDir.create(config.load_recipe(None, ["name=r"]), root=tmp_path)
    locking.release_all()
    refused(["finetune", "--resume", str(run.path), "--out", str(tmp_path / "elsewhere")], capsys,
            "drop --out")
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--sigma", "1", "--sample-rate", "0.01", "--steps", "100", "--delta", "0.5"], "δ = 0.5 (--delta)"),
    (["--sigma", "1", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--prv-eps-error", "0"],
     "--prv-eps-error must be a positive"),
])
def test_account_refuses_a_meaningless_delta_and_a_zero_prv_width(args, fragment, capsys):
    refused(["account", *args], capsys, fragment)


def test_synth_refuses_a_top_p_above_one_and_a_file_as_out(tmp_path, capsys):
    refused(["synth", str(tmp_path / "no-teacher"), "--out", str(tmp_path / "s"), "--n", "4", "--top-p", "1.5"],
            capsys, "--top-p must be in (0, 1]")
    (tmp_path / "taken").write_text("")
    refused(["synth", str(tmp_path / "no-teacher"), "--out", str(tmp_path / "taken"), "--n", "4"], capsys,
            "is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_mia_max_examples_zero_and_decode_empty_prompt(tmp_path, capsys):
    refused(["mia", str(tmp_path / "run"), "--max-examples", "0"], capsys, "--max-examples must be at least 1")
    refused(["decode", "--model", "tiny-gpt2", "--lambda", "0.8", "--prompt", ""], capsys, "--prompt is empty")


def test_bench_memory_refuses_no_modes_and_a_file_as_out_before_running(tmp_path, capsys):
    refused(["bench-memory", "tiny-gpt2", "--modes", "", "--out", str(tmp_path / "b")], capsys, "choose from")
    (tmp_path / "taken").write_text("")
    refused(["bench-memory", "tiny-gpt2", "--modes", "nonprivate", "--out", str(tmp_path / "taken")], capsys,
            "is a file, not a folder")


def test_members_cut_mid_line_is_one_sentence(tmp_path):
    from dptext.attacks.audit_records import read_records
    from dptext.data.audit_split import AUDIT_DIR

    (tmp_path / AUDIT_DIR).mkdir()
    lines = [json.dumps({"index": i, "record": {"text": f"t{i}"}}) for i in range(3)]
    (tmp_path / AUDIT_DIR / "members.jsonl").write_text("\n".join(lines)[:-7])
    with pytest.raises(UserError, match="damaged at record 3"):
        read_records(tmp_path, "members")


def test_a_teacher_run_given_as_synthetic_data_is_named(tmp_path):
    from dptext.distill.run import synthetic_provenance

    run = runs.RunDir.create(config.load_recipe(None, ["name=teacher"]), root=tmp_path)
    locking.release_all()
    with pytest.raises(UserError, match="is a run directory, not a `dptext synth` folder"):
        synthetic_provenance(str(run.path), None)


def test_duplicated_rows_across_train_and_test_are_counted_and_warned(tmp_path, capsys):
    from dptext.finetune.validate import copies_in_training
    from test_bad_input_cases import cli, own_data

    assert copies_in_training([{"text": "a"}, {"text": "b"}], [{"text": "a"}, {"text": "c"}, {"text": "a"}]) == 2
    texts = [f"review number {i // 2} was {'good' if i // 2 % 2 else 'bad'}" for i in range(48)]  # every row twice
    data = own_data(tmp_path, labels=[i // 2 % 2 for i in range(48)], texts=texts)
    code, err = cli(finetune(tmp_path, f"data.path={data}", "train.max_steps=1"), capsys)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if "word-for-word copy" in line)
    diagnostics = runs.RunDir(tmp_path / "run").read_metrics(runs.DIAGNOSTICS)
    copies = next(r["copies"] for r in diagnostics if r.get("event") == "split_copies")
    assert copies > 0 and warning.startswith(f"warning: {copies} of the ")


def test_a_delta_of_one_in_ten_or_more_is_refused_unless_allowed(tmp_path, capsys):
    from test_bad_input_cases import cli

    line = refused(finetune(tmp_path, "privacy.delta=0.2"), capsys, "δ = 0.2 (given)", "privacy.allow_large_delta")
    assert "meaningless" in line and not (tmp_path / "run").exists()
    refused(["check", *finetune(tmp_path, "privacy.delta=0.2")[1:-2]], capsys, "privacy.allow_large_delta=true")
    code, err = cli(["check", *finetune(tmp_path, "privacy.delta=0.2", "privacy.allow_large_delta=true")[1:-2]],
                    capsys)
    assert code == 0 and "warning: δ = 0.2 is at least 1/n = 1/20" in err, err  # allowed, still warned
    refused(["account", "--sigma", "1", "-q", "0.5", "--steps", "3", "--delta", "0.1"], capsys,
            "δ = 0.1 (--delta)", "--allow-large-delta")
    refused(["account", "--sigma", "1", "--batch-size", "1", "-n", "2", "--steps", "3"], capsys,
            "δ = 0.25 (1/(2n) with n=2", "--allow-large-delta")  # the default δ of a tiny n
    code, err = cli(["account", "--sigma", "1", "-q", "0.5", "--steps", "3", "--delta", "0.1",
                     "--allow-large-delta", "--method", "rdp"], capsys)
    assert code == 0, err


def test_a_delta_of_one_over_n_or_more_is_warned_in_the_summary_and_the_diagnostics(tmp_path, capsys):
    from test_bad_input_cases import cli

    code, err = cli(finetune(tmp_path, "privacy.delta=0.05", "train.max_steps=1"), capsys)  # n = 20: 1/n = 0.05
    warnings = [line for line in err.splitlines() if line.startswith("warning: δ = 0.05 is at least 1/n = 1/20")]
    assert code == 0 and len(warnings) == 2, err  # at the start and in the summary
    diagnostics = runs.RunDir(tmp_path / "run").read_metrics(runs.DIAGNOSTICS)
    noted = [r for r in diagnostics if r.get("event") == "delta_warning"]
    assert [(r["n"], r["delta"]) for r in noted] == [(20, 0.05)], diagnostics


def test_an_evaluation_split_without_a_record_is_refused(tmp_path, capsys):
    one = tmp_path / "one.csv"
    one.write_text("text,label\nhello there,positive\n")
    # a 1-record file (it printed δ = 0.5 and "ε ≤ 8" with no metric): no validation record, and δ = 1/(2n) = 0.5
    for allowed in (["privacy.allow_large_delta=true"], []):
        refused(finetune(tmp_path, f"data.path={one}", "train.batch_size=1", *allowed), capsys,
                "The validation split (eval.split) has no record", "data.validation_fraction")
    refused(["check", *finetune(tmp_path, f"data.path={one}", "train.batch_size=1")[1:-2]], capsys,
            "δ = 0.5 (1/(2n) with n=1")
    assert not (tmp_path / "run").exists()


def test_account_on_an_unfinished_synth_folder_says_what_is_missing(tmp_path, capsys):
    from dptext.cli.app import main

    out = tmp_path / "synthetic"
    out.mkdir()
    runs.write_manifest(out, "synth")
    runs.atomic_write_json(out / "plan.json", {"n": 4})
    runs.atomic_write_text(out / "chunks" / "part-00000.jsonl", "{}\n")
    for name in ("train.jsonl", "summary.json"):
        runs.atomic_write_text(out / name, "{}\n")
    for name in ("train.jsonl", "summary.json"):  # listed once written, gone since (deleted, or a copy cut short)
        (out / name).unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["account", str(out), "--json"])
    printed = capsys.readouterr()
    assert code.value.code == 0, printed.err
    report = json.loads(printed.out)
    assert report["missing"] == ["summary.json", "train.jsonl"]
    statuses = {f["path"]: f["status"] for f in report["release"]["files"]}
    assert statuses["plan.json"] == "covered"
    with pytest.raises(SystemExit):
        main(["account", str(out)])
    printed = capsys.readouterr()
    rows = {line.split()[0]: line.split()[1] for line in printed.out.splitlines()[2:] if line.strip()}
    assert rows["train.jsonl"] == rows["summary.json"] == "MISSING" and rows["plan.json"] == "covered", printed.out
    assert "2 file(s) that release.json lists are missing" in printed.err, printed.err
    assert "unfinished `dptext synth` folder" in printed.err and "the same `dptext synth` command" in printed.err
