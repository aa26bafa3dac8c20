"""The privacy engine's per-example norms and clipped sums on one device, in fp32 and bf16, against fp64 brute force.

    python benchmarks/gpu_exactness.py --device cuda --out exactness.json
    python benchmarks/gpu_exactness.py --device cpu --tiny --out exactness.json   # the rehearsal (TINY_CELLS)

Issue 44's first step of the GPU check (benchmarks/device/gpu_check.sh). A *cell* is (architecture, situation,
clipping mode, precision). The models and batches are the architecture matrix's (tests/arch_cases.py: tiny random
models built in code, dropout off, C small enough that every example is clipped): GPT-2, Llama (tied embeddings),
Qwen2, BERT, RoBERTa, each with a right-padded batch of 3 (B ≠ T), a batch with B = T = 4, and LoRA adapters
(peft) on the first block's projections. Precisions:
* ``fp32``: the model in fp32;
* ``bf16_autocast``: fp32 weights, the forward under ``torch.autocast(dtype=torch.bfloat16)`` and the engine's
  ``accumulate`` after it, as ``dptext finetune`` runs on a GPU;
* ``bf16_weights``: the model cast to bf16 (no autocast).
The PrivacyEngine (its public API: ``accumulate(losses)``, ``clipped_grads()``), built with its defaults (so with
its start-up proof, where it has one: each cell records ``proof_ran``; bf16 cells prove in the model's own
precision, as models above 50M parameters do, ``probed_as_real_models``), runs on the device; the reference
is a loop of per-example autograd over batches of one on the same device, its norms, factors and clipped sums formed
in fp64: for fp32 cells on an fp64 copy of the same parameter values (the exact math), for bf16 cells in the same
bf16 arithmetic (see Tolerances).

What is compared (the three numbers each cell records in ``max_error``):
* ``norms``: each example's gradient norm, relative error, worst example;
* ``sum``: the clipped sum of all parameters as one vector, ‖got − expected‖₂ / ‖expected‖₂;
* ``layer``: each parameter's clipped sum the same way, against max(‖expected_p‖₂, 1e-2 · the largest ‖expected_q‖₂),
  worst parameter (a parameter whose gradient is zero in exact arithmetic, such as a key bias, holds only rounding
  noise; a layer whose rule is wrong or missing is off by O(1) however small it is).

Tolerances (``TOLERANCE``):
* fp32 cells, against the exact math (fp64): 1e-4 for all three (tests/arch_cases.FP32_RTOL): fp32 rounding only;
  on CUDA, matmuls run without TF32 here (recorded in the JSON's setup).
* bf16 cells, against the fp64 reference of the *same* bf16 computation: per-example autograd on batches of one
  under the same autocast or with the same bf16 weights, its gradients then upcast to fp64 and norms, factors and
  sums formed in fp64. bf16 keeps 8 bits of mantissa (a rounding is off by up to 2⁻⁹ ≈ 2e-3), and the engine's
  batched forward and its own reductions round in other places than a batch of one does, so the two agree to
  rounding, not to the bit: 2e-2 for ``norms`` and ``sum`` (measured on the CPU over all 90 bf16 cells: at most
  1.5e-3 and 1.2e-2), 0.15 for ``layer`` (measured: at most 5.8e-2, ghost mode with LoRA adapters, whose gradients
  are small and cancel across tokens, so that bf16 rounding of the larger terms is a larger share of them). 2e-2 is
  also the engine's
  own slack for sums formed in bf16 in its per-step invariant (``dptext.privacy.clipping.sums.invariant_tolerance``).
  bf16 cells also record ``error_vs_fp64``, the same numbers against the exact math (not gated: that is bf16's
  own error, measured at most 1.5e-2 for ``sum`` on the CPU).

Sensitivity (the red-team test): removing any one example moves the engine's clipped sum (all parameters, one
vector) by at most C·(1 + the cell's ``sum`` tolerance), and by more than C/2 (the bound is reached: the examples
are clipped, so the test is not vacuous). Measured on the CPU: at most 1.0000001·C in fp32, 1.0082·C in bf16.

Each cell is ``exact``, ``refused`` (the engine raised ``UserError``; its sentence is kept) or ``FAILED`` (with
what differed, or the exception). The JSON is rewritten after every cell, so a run cut off by its time limit
keeps every finished cell. Exit status 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from arch_cases import BY_NAME, CLIP, FP32_RTOL, SITUATIONS, losses, make_batch, prepare  # noqa: E402  (tests/)
from arch_cases import build as build_fp64  # noqa: E402

from dptext.errors import UserError  # noqa: E402
from dptext.privacy import PrivacyEngine  # noqa: E402
from dptext.runs import atomic_write_json  # noqa: E402

ARCHS = ("gpt2", "llama", "qwen2", "bert", "roberta")
SITUATION_NAMES = ("default", "batch_eq_length", "lora")
MODES = ("bookkeeping", "ghost", "per_sample")
PRECISIONS = ("fp32", "bf16_autocast", "bf16_weights")
BF16 = {"norms": 2e-2, "sum": 2e-2, "layer": 0.15}
TOLERANCE = {"fp32": {"norms": FP32_RTOL, "sum": FP32_RTOL, "layer": FP32_RTOL}, "bf16_autocast": BF16,
             "bf16_weights": BF16}
LAYER_FLOOR = 1e-2
# The engine's start-up proof (engine.verify() on synthetic inputs, run before the first step by default) runs in
# each cell's main engine; the remove-one-example engines skip it where the engine lets them (it does not change a
# sum, and it costs more than the step on these tiny models).
NO_PROOF = {"verify": False} if "verify" in inspect.signature(PrivacyEngine).parameters else {}
# --tiny (the CPU rehearsal): two decoders in fp32 in every mode, and one bf16 path of each kind on the default batch
TINY_CELLS = ([(arch, situation, mode, "fp32") for arch in ("gpt2", "llama") for situation in SITUATION_NAMES
               for mode in MODES] +
              [("llama", "default", mode, precision) for precision in ("bf16_autocast", "bf16_weights")
               for mode in MODES])


def all_cells() -> list[tuple[str, str, str, str]]:
    """Every (architecture, situation, mode, precision), one situation at a time: a run cut off by its time limit
    has still covered every architecture, mode and precision."""
    return [(arch, situation, mode, precision) for situation in SITUATION_NAMES for arch in ARCHS
            for precision in PRECISIONS for mode in MODES]


def cast(model: torch.nn.Module, precision: str, device: torch.device) -> torch.nn.Module:
    dtype = torch.bfloat16 if precision == "bf16_weights" else torch.float32
    return copy.deepcopy(model).to(device=device, dtype=dtype)


def forward_context(precision: str, device: torch.device):
    if precision == "bf16_autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def probed_as_real_models(precision: str):
    """bf16 cells: the start-up proof in the model's own precision (fp32 weights: fp32), as every model above
    ``FP64_PARAMETERS`` (50M) gets it, instead of the fp64 copy these tiny models would get. The first GPU run
    (H200) found the fp32 probe made at a training forward under bf16 autocast refusing every layer of a 1.1B
    Llama, which the fp64 probe of these cells never showed (autocast leaves fp64 alone)."""
    if precision == "fp32":
        yield
        return
    from dptext.privacy.proof import verify

    before, verify.FP64_PARAMETERS = verify.FP64_PARAMETERS, 0
    try:
        yield
    finally:
        verify.FP64_PARAMETERS = before


def clipped(model, batch: dict, mode: str, precision: str, rows=slice(None), proof: bool = True):
    """The engine on ``batch[rows]``: (per-example norms, {name: clipped sum}, whether its start-up proof ran);
    raises UserError where refused. ``proof=False`` builds it without the proof (where the engine can)."""
    sub = {key: value[rows] for key, value in batch.items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                           dataset_size=100, clipping_mode=mode, **({} if proof else NO_PROOF))
    try:
        with forward_context(precision, sub["input_ids"].device), probed_as_real_models(precision):
            per_example = losses(model, sub)
        norms = engine.accumulate(per_example)  # outside autocast, as dptext.finetune.loop calls it
        got = engine.clipped_grads()
        return norms, {name: got[param] for name, param in model.named_parameters() if param in got}, engine.verified
    finally:
        engine.detach()


def flat(sums: dict) -> torch.Tensor:
    return torch.cat([sums[name].double().flatten() for name in sorted(sums)])


def sensitivity(model, batch: dict, mode: str, precision: str, full: dict) -> float:
    """The largest move of the clipped sum (one vector) when one example is removed, in units of C."""
    size = len(batch["input_ids"])
    moves = []
    for removed in range(size):
        keep = torch.tensor([i for i in range(size) if i != removed], device=batch["input_ids"].device)
        fewer = clipped(model, batch, mode, precision, keep, proof=False)[1]
        moves.append(float((flat(full) - flat(fewer)).norm()))
    return max(moves) / CLIP


def reference(model, batch: dict, precision: str) -> tuple[torch.Tensor, dict]:
    """Brute force: each example's gradient by autograd on a batch of one, in ``precision``'s arithmetic, then in
    fp64 its norm, its factor min(1, C / (‖g‖ + 1e-6)) and the clipped sum."""
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    rows = []
    for i in range(len(batch["input_ids"])):
        with forward_context(precision, batch["input_ids"].device):
            loss = losses(model, batch, slice(i, i + 1)).sum()
        grads = torch.autograd.grad(loss, [param for _, param in named], allow_unused=True)
        rows.append([torch.zeros_like(param, dtype=torch.float64) if grad is None else grad.double()
                     for grad, (_, param) in zip(grads, named)])
    norms = torch.stack([torch.stack([grad.pow(2).sum() for grad in row]).sum().sqrt() for row in rows])
    factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    return norms, {name: sum(c * row[k] for c, row in zip(factors, rows)) for k, (name, _) in enumerate(named)}


def relative_errors(expected: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict]) -> dict:
    """``norms``, ``sum`` and ``layer`` (see the module docstring) of ``got`` against ``expected``."""
    (norms, sums), (got_norms, got_sums) = expected, got
    differences = {name: got_sums.get(name, torch.zeros_like(value)).double() - value for name, value in sums.items()}
    largest = max(float(value.norm()) for value in sums.values())
    return {"norms": float(((got_norms.double() - norms).abs() / norms.clamp(min=1e-12)).max()),
            "sum": float(flat(differences).norm() / flat(sums).norm()),
            "layer": max(float(differences[name].norm()) / max(float(value.norm()), LAYER_FLOOR * largest, 1e-30)
                         for name, value in sums.items())}


def run_cell(arch_name: str, situation: str, mode: str, precision: str, device: torch.device) -> dict:
    arch, where, tolerance = BY_NAME[arch_name], SITUATIONS[situation], TOLERANCE[precision]
    cell = {"arch": arch_name, "situation": situation, "mode": mode, "precision": precision}
    start = time.perf_counter()
    try:
        model = cast(prepare(build_fp64(arch), where), precision, device)
        batch = {key: value.to(device) for key, value in make_batch(arch, where).items()}
        exact_math = reference(copy.deepcopy(model).double(), batch, "fp64")  # the same parameter values, exactly
        expected = exact_math if precision == "fp32" else reference(copy.deepcopy(model), batch, precision)
        try:
            norms, sums, cell["proof_ran"] = clipped(model, batch, mode, precision)
            moved = sensitivity(model, batch, mode, precision, sums)
        except UserError as error:
            return dict(cell, outcome="refused", reason=str(error), seconds=time.perf_counter() - start)
        errors = relative_errors(expected, (norms, sums))
        problems = [f"{what}: relative error {errors[what]:.2e} > {tolerance[what]:g}" for what in errors
                    if errors[what] > tolerance[what]]
        if moved > 1 + tolerance["sum"]:
            problems.append(f"removing one example moved the clipped sum by {moved:.4f}·C > "
                            f"(1 + {tolerance['sum']:g})·C")
        if moved <= 0.5:
            problems.append(f"removing one example moved the clipped sum by only {moved:.4f}·C (vacuous test)")
        cell.update(outcome="FAILED" if problems else "exact", max_error=errors, sensitivity_c=moved,
                    problems=problems)
        if precision != "fp32":
            cell["error_vs_fp64"] = relative_errors(exact_math, (norms, sums))
    except Exception as error:  # a crash is a failed cell, not the end of the check
        cell.update(outcome="FAILED", problems=[f"{type(error).__name__}: {error}".splitlines()[0][:500]],
                    traceback=traceback.format_exc()[-2000:])
    cell["seconds"] = time.perf_counter() - start
    return cell


def device_facts(device: torch.device) -> dict:
    facts = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        facts.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    facts["float32_matmul_precision"] = torch.get_float32_matmul_precision()  # "highest": no TF32
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the CPU rehearsal's few cells (see TINY_CELLS)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file, rewritten after every cell")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # peft's and transformers' notes on the tiny configs, once per cell
    device = torch.device(args.device)
    cells = TINY_CELLS if args.tiny else all_cells()
    report = {"setup": {**device_facts(device), "clip": CLIP, "tolerance": TOLERANCE, "layer_floor": LAYER_FLOOR,
                        "tiny": args.tiny, "planned": len(cells)}, "cells": []}
    for arch_name, situation, mode, precision in cells:
        cell = run_cell(arch_name, situation, mode, precision, device)
        report["cells"].append(cell)
        report["summary"] = summary(report["cells"])
        atomic_write_json(args.out, report)
        print(f"{cell['outcome']:8s} {arch_name:8s} {situation:16s} {mode:12s} {precision:14s} "
              f"{cell['seconds']:.2f} s {'; '.join(cell.get('problems', []))}", flush=True)
    print(report["summary"])
    return 1 if report["summary"]["FAILED"] else 0


def summary(cells: list[dict]) -> dict:
    return {outcome: sum(cell["outcome"] == outcome for cell in cells) for outcome in ("exact", "refused", "FAILED")}


if __name__ == "__main__":
    sys.exit(main())
