"""`dptext decode` end to end on tiny models, through the real CLI entry point."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dptext.cli.app import main
from dptext.decoding import epsilon_for_lambda

V = 261


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture
def held_out(tmp_path):
    path = tmp_path / "held_out.txt"
    path.write_text("The cat sat on the mat.\nBlue Spice is a coffee shop.\nA third sentence here.\n")
    return path


def test_generation_reports_the_epsilon_of_the_query(capsys):
    code, out, err = run_cli(capsys, "--model", "tiny-gpt2", "--prompt", "Hello", "--lambda", "0.8",
                             "--max-new-tokens", "4", "--seed", "0", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["lambda"] == 0.8 and result["support_size"] == V
    assert result["outputs"][0]["epsilon"] == pytest.approx(epsilon_for_lambda(0.8, V, 4))
    again = json.loads(run_cli(capsys, "--model", "tiny-gpt2", "--prompt", "Hello", "--lambda", "0.8",
                               "--max-new-tokens", "4", "--seed", "0", "--json")[1])
    assert again["outputs"][0]["text"] == result["outputs"][0]["text"]  # --seed reproduces
    assert result["seeded"] is True and "seed" not in result  # the seed never goes out with the outputs
    unseeded = json.loads(run_cli(capsys, "--model", "tiny-gpt2", "--prompt", "Hello", "--lambda", "0.8",
                                  "--max-new-tokens", "4", "--json")[1])
    assert unseeded["seeded"] is False and "seed" not in unseeded


def test_eps_solves_lambda_for_t_and_v(capsys):
    code, out, _ = run_cli(capsys, "--model", "tiny-gpt2", "--prompt", "Hi", "--eps", "10", "--max-new-tokens", "5",
                           "--json")
    assert code == 0
    result = json.loads(out)
    assert epsilon_for_lambda(result["lambda"], V, 5) == pytest.approx(10, rel=1e-9)
    assert result["outputs"][0]["epsilon"] <= 10


def test_mask_filling_with_a_masked_lm(capsys):
    code, out, _ = run_cli(capsys, "--model", "tiny-roberta", "--prompt", "The <mask> sat on <mask>.",
                           "--lambda", "0.5", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["mode"] == "fill_masks" and result["outputs"][0]["tokens"] == 2
    assert result["outputs"][0]["epsilon"] == pytest.approx(epsilon_for_lambda(0.5, V, 2))


def test_public_support_through_the_cli(capsys):
    code, out, _ = run_cli(capsys, "--model", "tiny-gpt2", "--public-model", "tiny-llama", "--top-k", "8",
                           "--prompt", "Hi", "--lambda", "0.5", "--max-new-tokens", "3", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["support_size"] == 8
    assert result["outputs"][0]["epsilon"] == pytest.approx(3 * math.log((1 + 7 * 0.5) / 0.5))


def test_sweep_with_json_table_and_plot(capsys, held_out, tmp_path):
    plot = tmp_path / "sweep.png"
    code, out, _ = run_cli(capsys, "--model", "tiny-gpt2", "--data", str(held_out), "--sweep", "0:1:0.5",
                           "--plot", str(plot), "--json")
    assert code == 0
    result = json.loads(out)
    assert [row["lam"] for row in result["rows"]] == [0.0, 0.5, 1.0]
    assert result["rows"][0]["perplexity"] == pytest.approx(V)
    assert result["rows"][2]["epsilon"] == "inf"  # JSON has no infinity; the output layer writes "inf"
    assert plot.read_bytes().startswith(b"\x89PNG")
    code, out, _ = run_cli(capsys, "--model", "tiny-gpt2", "--data", str(held_out), "--sweep", "0.5,1")
    assert code == 0 and "perplexity" in out and "vs λ=1" in out


def test_masked_lm_sweep_through_the_cli(capsys, held_out):
    code, out, _ = run_cli(capsys, "--model", "tiny-roberta", "--data", str(held_out), "--sweep", "0.8,1",
                           "--max-examples", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["kind"] == "masked_lm" and result["maskings"] == 3 and result["examples"] == 2


@pytest.mark.parametrize("args", [
    ["--prompt", "Hi", "--lambda", "1.0"],
    ["--prompt", "Hi", "--lambda", "-0.1"],
    ["--prompt", "Hi", "--eps", "0"],
    ["--prompt", "Hi", "--eps", "-3"],
    ["--prompt", "Hi", "--lambda", "0.5", "--greedy"],
    ["--prompt", "Hi", "--lambda", "0.5", "--num-beams", "4"],
    ["--prompt", "Hi", "--lambda", "0.5", "--top-k", "50"],
    ["--prompt", "Hi", "--lambda", "0.5", "--top-p", "0.9"],
    ["--prompt", "Hi", "--lambda", "0.5", "--eps", "3"],
    ["--prompt", "Hi"],
    [],
    ["--data", "/nonexistent/held_out.txt"],
    ["--data", "/nonexistent/held_out.txt", "--sweep", "0:2:0.5"],
])
def test_bad_input_is_one_sentence_and_exit_2(capsys, args):
    code, out, err = run_cli(capsys, "--model", "tiny-gpt2", *args)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_bad_sweep_values_exit_2(capsys, held_out):
    for spec in ("0:2:0.5", "x"):
        code, _, err = run_cli(capsys, "--model", "tiny-gpt2", "--data", str(held_out), "--sweep", spec)
        assert code == 2 and err.startswith("error: ")


def test_cli_module_imports_nothing_heavy():
    code = ("import sys, dptext.cli.decode; heavy = {'torch', 'transformers', 'numpy'} & set(sys.modules); "
            "sys.exit(f'imported {heavy}' if heavy else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)
