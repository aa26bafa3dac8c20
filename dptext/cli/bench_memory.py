"""`dptext bench-memory`: time and memory of private training modes against non-private training."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output


def bench_memory(
    model: Annotated[str, typer.Argument(help="Model alias or hub name, e.g. tiny-gpt2 or smollm2-135m.")],
    seq_len: Annotated[int, typer.Option("--seq-len", help="Sequence length T.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Batch size B for the timed steps.")] = 8,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per mode (the median is reported).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per mode.")] = 2,
    rounds: Annotated[int, typer.Option("--rounds", help="Run all modes round-robin this many times (on a "
                                        "shared machine, spreads passing load over every mode).")] = 1,
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated modes: nonprivate, per_sample, ghost, "
                                       "bookkeeping, banded_mf and blt (book-keeping with correlated noise), "
                                       "opacus, opacus_untied.")] =
    "nonprivate,per_sample,ghost,bookkeeping,opacus,opacus_untied",
    precision: Annotated[str, typer.Option("--precision", help="auto (bf16 autocast on GPU, fp32 on CPU), "
                                           "fp32, bf16 or fp16.")] = "auto",
    max_batch: Annotated[bool, typer.Option("--max-batch/--no-max-batch",
                                            help="On GPU, search each mode's largest batch.")] = True,
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder for bench.json and bench.png "
                                                "(default: runs/bench-memory-<model>-T<T>-B<B>).")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Step time and peak memory of non-private, per-sample, ghost, book-keeping and opacus training."""
    from dptext import bench
    from dptext.errors import UserError
    from dptext.runs import atomic_write_json

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if m not in bench.MODES]
    if unknown or not chosen:
        raise UserError(f"Unknown mode(s) {', '.join(unknown) or repr(modes)}; choose from {', '.join(bench.MODES)}.")
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise UserError(f"Unknown precision '{precision}'; choose auto, fp32, bf16 or fp16.")
    if seq_len < 2 or batch_size < 1 or steps < 1 or warmup < 0 or rounds < 1:
        raise UserError("Use --seq-len ≥ 2, --batch-size ≥ 1, --steps ≥ 1, --warmup ≥ 0 and --rounds ≥ 1.")
    from dptext.model_check import check_model_name

    check_model_name(model, key="MODEL")  # an unknown name: one sentence now, not a failure per mode later
    out_dir = out or Path("runs") / f"bench-memory-{Path(model).name}-T{seq_len}-B{batch_size}"
    if out_dir.exists() and not out_dir.is_dir():  # found before the benchmark runs, not after
        raise UserError(f"--out '{out_dir}' is a file, not a folder; choose a folder for bench.json and bench.png.")
    output = make_output(json_mode)
    with output.progress(len(chosen) * rounds, "bench-memory") as progress:
        report = bench.run(model, seq_len, batch_size, device, steps, warmup, chosen, precision, max_batch, rounds,
                           progress=lambda mode, result: progress.advance(mode=mode))
    setup = report["setup"]
    columns = ["mode", "status", "step s", "time ×", "peak MB", "memory ×"]
    step_memory = setup["device"] == "cpu"
    on_gpu = not step_memory
    columns += ["step MB", "step memory ×"] if step_memory else []
    columns += ["max batch"] if on_gpu and max_batch else []
    rows = []
    for r in report["results"]:
        row = [r["mode"], r["status"], r.get("step_s"), r.get("time_ratio"), r.get("peak_mb"), r.get("memory_ratio")]
        row += [r.get("step_mb"), r.get("step_memory_ratio")] if step_memory else []
        row += [r.get("max_batch")] if on_gpu and max_batch else []
        rows.append(row)
    title = (f"{setup['model']}, T={setup['seq_len']}, batch {setup['batch_size']}, {setup['device']} "
             f"({setup['precision']}), median of {setup['steps'] * setup['rounds']} steps: {setup['machine']}")
    output.table(title, columns, rows)
    measured = [r for r in report["results"] if r["status"] == "ok"]
    if not measured:  # a benchmark with no number is a failure, not a result to file
        raise UserError(f"No mode could be measured ({report['results'][0]['mode']}: "
                        f"{report['results'][0]['status']}); fix that error and run bench-memory again.")
    atomic_write_json(out_dir / "bench.json", report)
    written = [out_dir / "bench.json"]
    if any("time_ratio" in r for r in report["results"]):
        bench.write_chart(report, out_dir / "bench.png")
        written.append(out_dir / "bench.png")
    output.info("wrote " + " and ".join(str(path) for path in written))
    output.result(report)


def register(app: typer.Typer) -> None:
    app.command("bench-memory")(bench_memory)
