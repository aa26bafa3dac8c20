"""`dptext synth`: DP synthetic text from a DP teacher run, conditioned on control codes (DistilDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output


def synth(
    teacher: Annotated[Path, typer.Argument(help="Finished `dptext finetune` run of the control-coded DP teacher.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the synthetic data; an unfinished one is resumed.")],
    n: Annotated[int, typer.Option("--n", help="Synthetic records to generate.")] = 1000,
    codes: Annotated[str, typer.Option("--codes", help="Code distribution: laplace or gaussian (a DP histogram over "
                                       "the declared code domain whose ε is added to the teacher's), or exact (the "
                                       "paper's private frequencies: the output is marked NOT covered by ε).")
                     ] = "laplace",
    code_epsilon: Annotated[Optional[float], typer.Option("--code-epsilon", help="ε of the DP code histogram "
                                                          "(default 1 for laplace).")] = None,
    code_delta: Annotated[Optional[float], typer.Option("--code-delta", help="δ of the Gaussian histogram.")] = None,
    code_domain: Annotated[Optional[str], typer.Option(
        "--code-domain", help="Every possible code, fixed without the data: 'category=books,dvd;rating=1,2,4,5' "
        "(default: task.code_domain of the teacher's recipe).")] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0: all).")] = 50,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 0.9,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Maximum tokens per text.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per generate call (does not change "
                                            "the output).")] = 32,
    validation_fraction: Annotated[float, typer.Option("--validation-fraction",
                                                       help="Share of records in validation.jsonl.")] = 0.01,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the codes, the split and the sampling.")] = 0,
    check_training_copies: Annotated[bool, typer.Option(
        "--check-training-copies", help="Count synthetic texts that copy a private training text into "
        "training_copies_not_private.json (reads the private data; not covered by ε, for the data owner).")] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    max_chunks: Annotated[Optional[int], typer.Option(
        "--max-chunks", help="Stop after this many batches (run again to continue).")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Generate synthetic (code, text) records from a DP teacher; the output carries the teacher's ε.

    Example:  dptext synth runs/teacher --out runs/synthetic --n 400 --max-new-tokens 32
    """
    from dptext.distill.codes import parse_domain
    from dptext.distill.synth import synthesize

    output = make_output(json_mode)
    summary = synthesize(teacher, out, n, code_mechanism=codes, code_epsilon=code_epsilon, code_delta=code_delta,
                         code_domain=parse_domain(code_domain), top_k=top_k, top_p=top_p, temperature=temperature,
                         max_new_tokens=max_new_tokens, batch_size=batch_size,
                         validation_fraction=validation_fraction, seed=seed,
                         check_training_copies=check_training_copies, device=device, max_chunks=max_chunks,
                         output=output)
    render(output, out, summary)
    output.result(summary)


def render(output, out: Path, summary: dict) -> None:
    if not summary.get("complete", True):
        output.info(f"Stopped with {summary['records_on_disk']} records on disk; run the same command to continue.")
        return
    import json

    privacy = json.loads((out / "provenance.json").read_text())["privacy"]
    coverage, lengths = summary["code_coverage"], summary["length_tokens"]
    speed = summary["throughput_this_session"]
    rows = [["records (train / validation)", f"{summary['splits']['train']} / {summary['splits']['validation']}"],
            ["codes generated / in distribution", f"{coverage['codes_generated']} / "
                                                  f"{coverage['codes_in_distribution']}"],
            ["code TV distance to distribution", coverage["total_variation_to_distribution"]],
            ["tokens: mean / median / p90 / max", f"{lengths['mean']:.1f} / {lengths['median']} / {lengths['p90']} / "
                                                  f"{lengths['max']}"],
            ["share cut at max tokens", lengths["hit_max_new_tokens"]],
            ["exact duplicate rate", summary["exact_duplicate_rate"]],
            ["examples/s (this session)", speed["examples_per_second"]],
            ["ε (teacher + codes)", privacy["epsilon"]], ["δ", privacy["delta"]]]
    copies = out / "training_copies_not_private.json"
    if copies.is_file():
        rows.append(["copies of private training texts (not covered)", json.loads(copies.read_text())["count"]])
    output.table(f"Synthetic data in {out}", ["", "value"], rows)
    output.info(f"Privacy: {privacy['composition']}; {privacy['note']}.")


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)
