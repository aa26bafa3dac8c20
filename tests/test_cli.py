"""The CLI contract: fast start-up, documented options, one-sentence errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import click
import pytest
import typer

from dptext.cli.app import build_app, main

HEAVY_MODULES = ("torch", "transformers", "numpy", "scipy", "datasets", "prv_accountant", "matplotlib")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptext", *args], capture_output=True, text=True, timeout=300)


def test_building_the_app_imports_no_heavy_module():
    code = (
        "import sys; from dptext.cli.app import build_app; build_app(); "
        f"print([m for m in {HEAVY_MODULES!r} if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]", f"heavy modules imported at start-up: {proc.stdout}"


def test_help_starts_fast_and_lists_commands():
    run_cli("--help")  # warm the filesystem cache once
    start = time.monotonic()
    proc = run_cli("--help")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0
    assert elapsed < 1.5, f"dptext --help took {elapsed:.2f} s"
    for command in ("check", "models"):
        assert command in proc.stdout


def _commands() -> dict[str, click.Command]:
    return typer.main.get_command(build_app()).commands


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_documents_every_option_and_offers_json(name):
    command = _commands()[name]
    assert command.help, f"{name} has no help text"
    options = [p for p in command.params if isinstance(p, click.Option)]
    assert any("--json" in p.opts for p in options), f"{name} lacks --json"
    undocumented = [p.name for p in options if not p.help]
    assert not undocumented, f"{name}: options without help: {undocumented}"
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    assert all(getattr(p, "help", None) for p in arguments), f"{name}: an argument lacks help"
    proc = run_cli(name, "--help")
    assert proc.returncode == 0 and "--json" in proc.stdout


def _assert_one_sentence_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {proc.stderr!r}"
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_nonexistent_recipe_is_one_sentence_exit_2(tmp_path):
    _assert_one_sentence_error(run_cli("check", str(tmp_path / "missing.yaml")), "does not exist")


def test_unknown_recipe_key_suggests_the_nearest(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("privacy:\n  target_epsilon: 3\n  clip_norm: 0.1\n")
    proc = run_cli("check", str(recipe))
    _assert_one_sentence_error(proc, "privacy.clip_norm")
    assert "did you mean" in proc.stderr


def test_unknown_override_key_suggests_the_nearest(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    _assert_one_sentence_error(run_cli("check", str(recipe), "privacy.target_epsilo=3"), "privacy.target_epsilon")


def test_wrong_type_is_one_sentence(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  batch_size: lots\n")
    _assert_one_sentence_error(run_cli("check", str(recipe)), "train.batch_size", "int")


def test_missing_model_is_one_sentence(tmp_path):
    _assert_one_sentence_error(run_cli("models", "--check", str(tmp_path / "no-model")), "does not exist")


def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli("check", str(tmp_path / "missing.yaml"), "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "UserError" in proc.stderr


def test_usage_errors_exit_2():
    assert run_cli("check", "--no-such-flag").returncode == 2
    assert run_cli("no-such-command").returncode == 2


def test_check_json_is_parseable_and_resolved(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\nprivacy:\n  target_epsilon: 8\n")
    proc = run_cli("check", str(recipe), "privacy.target_epsilon=3", "train.epochs=1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["privacy"]["target_epsilon"] == 3.0 and data["train"]["epochs"] == 1.0
    assert data["name"] == "demo" and data["privacy"]["max_grad_norm"] == 0.1


def test_in_process_main_exits_2_on_user_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", str(tmp_path / "missing.yaml")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: Recipe file")


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("dptext ")


@pytest.mark.parametrize("args, code, words", [(["--version"], 0, "dptext "),
                                               (["account", "--no-such-option"], 2, "error: No such option")])
def test_a_rank_of_a_process_group_exits_with_its_code_and_its_words(args, code, words):
    """Under torchrun (WORLD_SIZE > 1) the process ends past the interpreter's teardown (os._exit, where gloo's
    threads could abort a finished rank): the exit code and everything printed still come out."""
    import os

    done = subprocess.run([sys.executable, "-m", "dptext", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WORLD_SIZE": "2"})
    assert done.returncode == code, done.stderr
    assert words in done.stdout + done.stderr, done.stdout + done.stderr
