"""The Markdown tables of a collected GPU check (benchmarks/collect_gpu.py): bench-memory against non-private and
opacus, the largest model, where the step's time goes, the finetune run, exactness against fp64 brute force."""

from __future__ import annotations

MODE_NAMES = {"nonprivate": "non-private", "bookkeeping": "dptext book-keeping", "ghost": "dptext ghost",
              "per_sample": "dptext per-sample", "opacus": "opacus 1.6 ghost", "opacus_untied": "opacus 1.6 ghost "
              "(untied copy)"}


def cell(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(value) if not isinstance(value, str) else value for value in row) + " |"
              for row in rows)]


def bench_lines(result: dict) -> list[str]:
    lines = []
    for report in result["bench"]:
        setup = report["setup"]
        rows = []
        for row in report["results"]:
            ok = row["status"] == "ok"
            rows.append([MODE_NAMES.get(row["mode"], row["mode"]), cell(row.get("step_s"), 3) if ok else row["status"],
                         row.get("time_ratio"), row.get("opacus_time_ratio"), cell(row.get("peak_mb"), 0),
                         row.get("memory_ratio"), row.get("opacus_memory_ratio"), row.get("max_batch")])
        reference = next((r.get("opacus_reference") for r in report["results"] if r.get("opacus_reference")), None)
        opacus = {"opacus": "opacus", "opacus_untied": "opacus (untied copy)"}.get(reference, "opacus")
        lines += [f"**{setup['model']}, T = {setup['seq_len']}, B = {setup['batch_size']}, {setup['precision']}** "
                  f"({setup['machine']}; median of {setup['steps'] * setup['rounds']} steps)", "",
                  *table(["mode", "step s", "time × non-private", f"time × {opacus}", "peak MiB",
                          "memory × non-private", f"memory × {opacus}", "largest batch"], rows), ""]
    return lines


def scale_lines(scale: dict | None) -> list[str]:
    if scale is None:
        return ["Largest model: not measured (no max_model.json and no rows in the log).", ""]
    rows = []
    for mode, largest in scale["largest"].items():
        row = next((r for r in scale["rows"] if r["mode"] == mode and r["layers"] == largest["layers"]), {})
        probe = f"{row['probe_seconds']:.1f} s = {row['probe_steps']:.1f} steps" if "probe_seconds" in row else "—"
        rows.append([mode, largest["layers"], largest["parameters"], row.get("step_seconds"),
                     row.get("peak_bytes") and row["peak_bytes"] / 2**30, probe])
    tried = [r for r in scale["rows"] if r.get("fits") is False]
    note = "; ".join(f"{r['mode']} at {r['layers']} layers: {why_not(r)}" for r in tried)
    return ["**Largest model** (" + scale.get("what", "benchmarks/max_model.py") +
            (", rows from the log: the step was cut off" if scale.get("from_log") else "") + ")", "",
            *table(["mode", "layers", "parameters", "step s", "peak GiB", "start-up proof"], rows),
            *(["", f"Not fitting: {note}."] if note else []), ""]


def why_not(row: dict) -> str:
    why = row.get("why", "does not fit")
    # before max_model.py skipped FSDP2 on one GPU, torchrun's failure banner ('====') stood as the reason
    return "its ranks failed to start (torchrun printed only its banner)" if not why.strip("= ") else why


def profile_lines(profile: dict | None) -> list[str]:
    if profile is None:
        return []
    base = profile["rows"][0]["wall_s"]
    rows = [[row["mode"], cell(row["wall_s"], 4), row["wall_s"] / base, cell(row.get("device_s"), 4),
             cell(row.get("device_share")), cell(row.get("kernels_per_step"), 0), cell(row.get("syncs_per_step"), 0),
             (row.get("top_device") or row["top_cpu"])[0]["op"][:60]] for row in profile["rows"]]
    return [f"**Where the step's time goes** ({profile['machine']}, {profile['model']}, T = {profile['seq_len']}, "
            f"B = {profile['batch_size']}, {profile['precision']}; torch.profiler over {profile['steps']} steps)", "",
            *table(["mode", "wall s", "× first", "device s", "device busy", "kernels", "syncs", "top op"], rows), ""]


def finetune_lines(run: dict | None) -> list[str]:
    if run is None:
        return []
    metrics = ", ".join(f"{name} {value:.4g}" for name, value in run["metrics"].items())
    return [f"**dptext finetune end to end**: {run['model']} ({run['task']}), {run['steps']} DP steps of expected "
            f"batch {run['expected_batch_size']:g} from {run['dataset_size']} records, {run['clipping_mode']}, "
            f"micro-batch {run['physical_batch_size']} (left to dptext), ε = {run['epsilon']:.2f} at "
            f"δ = {run['delta']:.2g}; {metrics} (random weights: the run is checked, not its score).", ""]


def error(value: float | None, tolerance: float) -> str:
    return f"{'—' if value is None else f'{value:.1e}'} (≤ {tolerance:g})"


def exactness_lines(summary: dict) -> list[str]:
    rows = [[g["precision"], g["mode"], g["exact"], g["refused"], g["FAILED"],
             *(error(g["worst"][what], g["tolerance"][what]) for what in ("norms", "sum", "layer")),
             cell(g["worst_sensitivity_c"], 4)] for g in summary["by"]]
    planned = f" of {summary['planned']} planned" if summary.get("planned") else ""
    return [f"**Exactness** against fp64 brute force: {summary['cells']} cells{planned}: {summary['exact']} exact, "
            f"{summary['refused']} refused, {summary['FAILED']} FAILED (the engine's start-up proof ran in "
            f"{summary.get('proof_ran', 0)})", "",
            *table(["precision", "mode", "exact", "refused", "FAILED", "worst norm error", "worst sum error",
                    "worst layer error", "worst move / C"], rows), ""]


def markdown(result: dict) -> str:
    head = (f"GPU check on **{result['device']}** at {result['commit']} (torch {result['torch']}"
            + (f", CUDA {result['cuda']}" if result.get("cuda") else "") + ")"
            + (" — a rehearsal, not a GPU result" if result["rehearsal"] else ""))
    steps = ", ".join(f"{name} {entry['seconds']:.0f} s ({entry['status']})" for name, entry in result["steps"].items())
    weights = [f"SmolLM2 weights: {result['smollm2_weights']}.", ""] if result.get("smollm2_weights") else []
    parts = "; ".join(f"{name}: {stamp['device']} at {stamp['commit'][:7]}"
                      for name, stamp in result.get("parts", {}).items())
    merged_note = [f"Merged runs, each part from one: {parts}.", ""] if parts else []
    return "\n".join([head, "", f"Steps: {steps}.", "", *merged_note, *weights, *bench_lines(result),
                      *scale_lines(result["scale"]), *profile_lines(result.get("profile")),
                      *finetune_lines(result.get("finetune")),
                      *exactness_lines(result["exactness"]["summary"])])
