"""``dptext bench-memory``: the cost of private training, side by side in one invocation.

For one model, sequence length T and batch size B, every mode runs in a fresh subprocess (so peak memory is
its own): non-private training, our three clipping modes, and opacus' ghost clipping when opacus is installed.
Each reports the median step time over repeated steps after warm-up (over several round-robin rounds with
``rounds`` > 1) and the peak memory (GPU:
``torch.cuda.max_memory_allocated``; CPU: the subprocess's peak RSS, and that peak minus the RSS after
loading the model, i.e. what the training step itself needs). On GPU each mode also finds its largest
batch by doubling and then bisecting until CUDA runs out of memory. Ratios are to the non-private run.

opacus refuses tied embeddings in ghost-clipping mode, so on a tied model its row says "unsupported" with
opacus' own reason, and a second row runs opacus on an explicitly untied copy (one more V×d matrix to
train) so that a time comparison exists; that row is labelled as such.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OURS = ("per_sample", "ghost", "bookkeeping")
MODES = ("nonprivate",) + OURS + ("opacus", "opacus_untied")
MAX_BATCH_CAP = 8192


# ---------------------------------------------------------------------------- inside one subprocess

def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _batch(vocab_size: int, batch_size: int, seq_len: int, device):
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    return ids, torch.ones_like(ids)


def _losses(model, ids, mask):
    """Per-example losses: next-token for a causal LM, else a sequence classifier against labels drawn from ids."""
    import torch

    from dptext.privacy import per_example_loss

    if _is_classifier(model):
        logits = model(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits, ids[:, 0] % logits.shape[-1], reduction="none")
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return per_example_loss(logits, ids, mask, shift=True)


def _is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def _make_step(mode: str, model, batch_size: int):
    """(step(ids, mask), close()) for one training mode on ``model``."""
    import torch

    from dptext.privacy import PrivacyEngine

    if mode == "nonprivate":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step(ids, mask):
            _losses(model, ids, mask).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, lambda: None
    if mode in OURS:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        engine = PrivacyEngine(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
                               expected_batch_size=batch_size, dataset_size=100 * batch_size, clipping_mode=mode)

        def step(ids, mask):
            engine.step(_losses(model, ids, mask))

        return step, engine.detach
    return _opacus_step(model, batch_size)


def _opacus_step(model, batch_size: int):
    import torch
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                   max_grad_norm=1.0, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(wrapped.parameters(), lr=1e-6),
                                                noise_multiplier=1.0, max_grad_norm=1.0,
                                                expected_batch_size=batch_size, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(wrapped, optimizer, torch.nn.CrossEntropyLoss(), loss_reduction="mean")

    def step(ids, mask):
        if _is_classifier(model):  # labels drawn from the ids, as in _losses
            # opacus needs every embedding's ids per example and contiguous (BERT broadcasts one row of each)
            per_example = {"token_type_ids": torch.zeros_like(ids),
                           "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous()}
            logits = wrapped(input_ids=ids, attention_mask=mask, **per_example).logits
            loss = criterion(logits, ids[:, 0] % logits.shape[-1])
        else:
            logits = wrapped(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            targets = ids[:, 1:]
            loss = criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=targets.shape)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, wrapped.remove_hooks


def _untie(model) -> None:
    import torch

    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runs(step, ids, mask, device) -> bool:
    """One step at this batch size, False if the device ran out of memory."""
    import torch

    try:
        step(ids, mask)
        _synchronize(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False


def _max_batch(mode: str, model, spec: dict, device) -> int:
    """Largest batch that trains without running out of GPU memory: double, then bisect."""
    import torch

    def fits(batch_size: int) -> bool:
        step, close = _make_step(mode, model, batch_size)
        try:
            return _runs(step, *_batch(model.config.vocab_size, batch_size, spec["seq_len"], device), device)
        finally:
            close()
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    good, bad = 0, None
    size = spec["batch_size"]
    while bad is None and size <= MAX_BATCH_CAP:
        if fits(size):
            good, size = size, size * 2
        else:
            bad = size
    bad = bad or size
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def measure(spec: dict) -> dict:
    """One mode, in this process: model, warm-up, timed steps, peak memory, (GPU) largest batch."""
    import torch

    from dptext.models import load_model

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    head = spec.get("head", "causal_lm")
    model, _ = load_model(spec["model"], head=head, num_labels=2 if head == "sequence_classification" else None)
    model.to(device).train()
    if spec["mode"] == "opacus_untied":
        _untie(model)
    ids, mask = _batch(model.config.vocab_size, spec["batch_size"], spec["seq_len"], device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    loaded_rss = _rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step, close = _make_step(spec["mode"], model, spec["batch_size"])
        times = []
        with autocast:
            for i in range(spec["warmup"] + spec["steps"]):
                start = time.perf_counter()
                step(ids, mask)
                _synchronize(device)
                if i >= spec["warmup"]:
                    times.append(time.perf_counter() - start)
        close()
    except Exception as exc:  # an unsupported model or mode is a result, not a crash of the benchmark
        return {"mode": spec["mode"], "status": f"unsupported: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    result = {"mode": spec["mode"], "status": "ok", "step_s": statistics.median(times), "times_s": times}
    if device.type == "cuda":
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        if spec["max_batch"]:
            with autocast:
                result["max_batch"] = _max_batch(spec["mode"], model, spec, device)
    else:
        result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["step_mb"] = result["peak_mb"] - loaded_rss
    return result


# ---------------------------------------------------------------------------- the parent process

def _run_in_subprocess(spec: dict) -> dict:
    # A fixed mmap threshold makes glibc return freed tensors to the OS, so peak RSS measures the peak of live
    # memory rather than heap fragmentation (glibc otherwise raises the threshold after the first large free).
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-m", "dptext.bench", json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"mode": spec["mode"], "status": f"failed: {reason[:300]}"}
    return json.loads(lines[-1])


def add_ratios(results: list[dict]) -> None:
    baseline = next((r for r in results if r["mode"] == "nonprivate" and r["status"] == "ok"), None)
    for result in results:
        if baseline is None or result["status"] != "ok":
            continue
        result["time_ratio"] = result["step_s"] / baseline["step_s"]
        result["memory_ratio"] = result["peak_mb"] / baseline["peak_mb"]
        if "step_mb" in result and baseline.get("step_mb", 0) > 0:
            result["step_memory_ratio"] = result["step_mb"] / baseline["step_mb"]


def merge_rounds(rounds: list[dict]) -> dict:
    """One mode's result over several rounds: all step times (median), the largest peak."""
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    if failed is not None:
        return failed
    merged = dict(rounds[0], times_s=[t for r in rounds for t in r["times_s"]])
    merged["step_s"] = statistics.median(merged["times_s"])
    for key in ("peak_mb", "step_mb", "max_batch"):
        values = [r[key] for r in rounds if key in r]
        if values:
            merged[key] = max(values)
    return merged


def run(model: str, seq_len: int, batch_size: int, device: str = "auto", steps: int = 5, warmup: int = 2,
        modes: tuple[str, ...] = MODES, precision: str = "auto", max_batch: bool = True, rounds: int = 1,
        progress=None) -> dict:
    """Benchmark every mode; returns {"setup": ..., "results": [one dict per mode]}.

    With ``rounds`` > 1 the modes run round-robin that many times and each reports the median over all its
    timed steps: on a shared machine, load that comes and goes then hits every mode alike."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") else "fp32"
    setup = {"model": model, "seq_len": seq_len, "batch_size": batch_size, "device": device,
             "precision": precision, "steps": steps, "warmup": warmup, "rounds": rounds,
             "machine": machine_description(device)}
    per_mode: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes:
            search = max_batch and device.startswith("cuda") and round_index == 0
            per_mode[mode].append(_run_in_subprocess(dict(setup, mode=mode, max_batch=search)))
            if progress is not None:
                progress(mode, per_mode[mode][-1])
    results = [merge_rounds(per_mode[mode]) for mode in modes]
    add_ratios(results)
    return {"setup": setup, "results": results}


def machine_description(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}")


def write_chart(report: dict, path: Path) -> None:
    """Bar chart of step time and peak memory relative to non-private training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if "time_ratio" in r]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, key, title in ((axes[0], "time_ratio", "step time"), (axes[1], "memory_ratio", "peak memory")):
        axis.bar([r["mode"] for r in rows], [r[key] for r in rows], color="#4c72b0")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(f"{title} / non-private")
        axis.tick_params(axis="x", rotation=30)
    setup = report["setup"]
    figure.suptitle(f"{setup['model']}, T={setup['seq_len']}, batch {setup['batch_size']}, {setup['device']}")
    figure.tight_layout()
    from dptext.runs import atomic_write

    atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=120), binary=True)
    plt.close(figure)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
