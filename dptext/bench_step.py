"""One mode of ``dptext bench-memory`` measured inside its own subprocess (``python -m dptext.bench SPEC``):
load the model, build the mode's training step (non-private, our clipping modes, opacus), warm up, time the
steps and read the peak memory; on GPU also the largest batch that fits. ``dptext.bench`` runs the modes and
compares them."""

from __future__ import annotations

import math
import resource
import statistics
import time

import torch

from dptext.accounting.banded_mf import Participation
from dptext.accounting.blt_strategy import optimize_blt
from dptext.accounting.mf_strategy import optimize_banded
from dptext.models import load_model
from dptext.privacy import BandedMFEngine, BLTEngine, PrivacyEngine, per_example_loss

OURS = ("per_sample", "ghost", "bookkeeping")
CORRELATED = ("banded_mf", "blt")  # book-keeping clipping with correlated noise (docs/correlated_noise.md)
STRATEGY_STEPS, STRATEGY_BINS = 2000, 500  # the strategy a 4-epoch run of 500 cyclic batches would optimise
BANDS, BUFFERS = 4, 4  # banded MF keeps b − 1 model-sized noise buffers (full after 3 steps), BLT d of them
MAX_BATCH_CAP = 8192


# ---------------------------------------------------------------------------- inside one subprocess

def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _batch(vocab_size: int, batch_size: int, seq_len: int, device):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    return ids, torch.ones_like(ids)


def _losses(model, ids, mask):
    """Per-example losses: next-token for a causal LM, else a sequence classifier against labels drawn from ids."""
    if _is_classifier(model):
        logits = model(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits, ids[:, 0] % logits.shape[-1], reduction="none")
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return per_example_loss(logits, ids, mask, shift=True)


def _is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def _make_step(mode: str, model, batch_size: int):
    """(step(ids, mask), close()) for one training mode on ``model``."""
    if mode == "nonprivate":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step(ids, mask):
            _losses(model, ids, mask).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, lambda: None
    if mode in OURS + CORRELATED:
        engine = _engine(mode, model, torch.optim.SGD(model.parameters(), lr=1e-6), batch_size)
        noise_seconds = _time_noise(engine)

        def step(ids, mask):
            engine.step(_losses(model, ids, mask))

        step.noise_seconds = noise_seconds
        return step, engine.detach
    return _opacus_step(model, batch_size)


def _engine(mode: str, model, optimizer, batch_size: int):
    """Our engine for ``mode``: a clipping mode with DP-SGD's noise, or book-keeping with a correlated-noise
    mechanism whose strategy is optimised as a run's would be. No proof: random tokens, no private data, and the
    step's cost is measured, not the proof's."""
    settings = dict(noise_multiplier=1.0, max_grad_norm=1.0, verify=False)
    if mode in OURS:
        return PrivacyEngine(model, optimizer, expected_batch_size=batch_size, dataset_size=100 * batch_size,
                             clipping_mode=mode, **settings)
    schema = Participation(math.ceil(STRATEGY_STEPS / STRATEGY_BINS), STRATEGY_BINS)
    settings.update(steps=STRATEGY_STEPS, bins=STRATEGY_BINS, dataset_size=batch_size * STRATEGY_BINS, seed=0)
    if mode == "banded_mf":
        coefficients = list(optimize_banded(STRATEGY_STEPS, BANDS, schema).coefficients)
        return BandedMFEngine(model, optimizer, coefficients=coefficients, **settings)
    return BLTEngine(model, optimizer, blt=optimize_blt(STRATEGY_STEPS, BUFFERS, schema).blt, **settings)


def _time_noise(engine) -> list[float]:
    """Seconds spent drawing the Gaussian noise, appended per call (the caller clears it per step): one draw per
    coordinate per step is a cost every DP-SGD pays whatever its clipping, so the grid reports it beside the step
    time."""
    noise, seconds = engine.dp_optimizer.noise, []
    draw = noise.normals

    def timed(*args, **kwargs):
        start = time.perf_counter()
        drawn = draw(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return drawn

    noise.normals = timed
    return seconds


def _opacus_step(model, batch_size: int):
    # optional dependency (opacus) or plotting only (matplotlib)
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
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runs(step, ids, mask, device) -> bool:
    """One step at this batch size, False if the device ran out of memory."""
    try:
        step(ids, mask)
        _synchronize(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False


def _max_batch(mode: str, model, spec: dict, device) -> int:
    """Largest batch that trains without running out of GPU memory: double, then bisect."""
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
        times, noise_times = [], []
        drawn = getattr(step, "noise_seconds", None)
        with autocast:
            for i in range(spec["warmup"] + spec["steps"]):
                if drawn is not None:
                    drawn.clear()  # this step's draws only
                start = time.perf_counter()
                step(ids, mask)
                _synchronize(device)
                if i >= spec["warmup"]:
                    times.append(time.perf_counter() - start)
                    if drawn is not None:
                        noise_times.append(sum(drawn))
        close()
    except Exception as exc:  # an unsupported model or mode is a result, not a crash of the benchmark
        return {"mode": spec["mode"], "status": f"unsupported: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    result = {"mode": spec["mode"], "status": "ok", "step_s": statistics.median(times), "times_s": times}
    if noise_times:
        result.update(noise_s=statistics.median(noise_times), noise_times_s=noise_times)
    if device.type == "cuda":
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        if spec["max_batch"]:
            with autocast:
                result["max_batch"] = _max_batch(spec["mode"], model, spec, device)
    else:
        result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["step_mb"] = result["peak_mb"] - loaded_rss
    return result
