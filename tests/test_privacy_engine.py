"""The privacy engine against brute-force per-example autograd (SPEC §1–2 correctness bar).

Every mode's per-example norms and clipped-and-summed gradients must equal those of a loop over batches of
one example, in float32, on the tiny GPT-2 / Llama / BERT / RoBERTa models (all with tied embeddings),
with padding, label masks, variable lengths, frozen layers and LoRA adapters.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine, per_example_loss

MODES = ("bookkeeping", "ghost", "per_sample")
MODELS = [("tiny-gpt2", "causal_lm"), ("tiny-llama", "causal_lm"), ("tiny-bert", "masked_lm"),
          ("tiny-roberta", "masked_lm")]
RTOL = 1e-4
CLIP = 0.5


def masked_batch(head: str, batch: int = 4, length: int = 12, seed: int = 0) -> dict:
    """Random ids with right padding of varying lengths, prompt tokens (-100) and, for MLMs, unmasked tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (batch, length), generator=generator)
    lengths = [length, length - 4, length // 2, 3, length - 1, 5][:batch]
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :3] = -100  # a prompt that must not be learned
    if head == "masked_lm":
        labels[:, ::2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "shift": head == "causal_lm"}


def losses(model: nn.Module, batch: dict, rows=slice(None), reduction: str = "sum") -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]).logits
    return per_example_loss(logits, batch["labels"][rows], batch["attention_mask"][rows], shift=batch["shift"],
                            reduction=reduction)


def brute_force(model: nn.Module, loss_of_rows, batch_size: int, clip: float = CLIP, per_layer: bool = False):
    """Per-example gradients by a loop over batches of one; returns (norms, {name: clipped sum})."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = [torch.autograd.grad(loss_of_rows(slice(i, i + 1)).sum(), [p for _, p in named], allow_unused=True)
             for i in range(batch_size)]
    grads = [[torch.zeros_like(p) if g is None else g for g, (_, p) in zip(row, named)] for row in grads]
    norms = torch.stack([torch.stack([g.pow(2).sum() for g in row]).sum().sqrt() for row in grads])
    sums = {}
    for k, (name, _) in enumerate(named):
        if per_layer:
            threshold = clip / math.sqrt(len(named))
            coef = [min(1.0, threshold / (float(row[k].norm()) + 1e-6)) for row in grads]
        else:
            coef = (clip / (norms + 1e-6)).clamp(max=1.0).tolist()
        sums[name] = sum(c * row[k] for c, row in zip(coef, grads))
    return norms, sums


def assert_clipped_sums_match(model: nn.Module, engine: PrivacyEngine, expected: dict, rtol: float = RTOL):
    """Compare per parameter; on failure list every parameter's error (opacus tests/grad_samples style)."""
    got = engine.clipped_grads()
    scale = max(float(e.abs().max()) for e in expected.values())
    report, failed = [], False
    for name, param in model.named_parameters():
        if name not in expected:
            continue
        value = got.get(param, torch.zeros_like(param))
        error = float((value - expected[name]).abs().max())
        bad = error > rtol * max(float(expected[name].abs().max()), 1e-2 * scale)
        failed |= bad
        report.append(f"{'FAIL' if bad else 'ok  '} {name}: max abs error {error:.3e}, "
                      f"max |grad| {float(expected[name].abs().max()):.3e}")
    assert not failed, "clipped sums differ from brute force:\n" + "\n".join(report)


def make_engine(model, mode="bookkeeping", **kwargs):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    settings = dict(noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4, dataset_size=100)
    settings.update(kwargs)
    return PrivacyEngine(model, optimizer, clipping_mode=mode, **settings, verify=False)


def check_against_brute_force(model, batch, mode, batch_size=4, **engine_kwargs):
    reference = copy.deepcopy(model)
    norms, expected = brute_force(reference, lambda rows: losses(reference, batch, rows), batch_size,
                                  per_layer=engine_kwargs.get("clipping_layout") == "per_layer")
    engine = make_engine(model, mode, **engine_kwargs)
    got_norms = engine.accumulate(losses(model, batch))
    torch.testing.assert_close(got_norms, norms, rtol=RTOL, atol=1e-6)
    assert_clipped_sums_match(model, engine, expected)
    return engine


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,head", MODELS)
def test_every_mode_matches_brute_force_on_tied_models(name, head, mode):
    model, _ = load_model(name, head=head)
    check_against_brute_force(model, masked_batch(head), mode)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_layers_are_skipped_and_the_rest_is_exact(mode):
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    for param in list(model.transformer.h[0].parameters()) + list(model.transformer.wpe.parameters()):
        param.requires_grad_(False)
    engine = check_against_brute_force(model, masked_batch("causal_lm"), mode)
    frozen = set(model.transformer.h[0].parameters())
    assert not frozen & set(engine.params)


@pytest.mark.parametrize("mode", MODES)
def test_peft_lora_model(mode):
    peft = pytest.importorskip("peft")
    base, _ = load_model("tiny-llama", head="causal_lm")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    engine = check_against_brute_force(model, masked_batch("causal_lm"), mode)
    assert all("lora_" in name for name, p in model.named_parameters() if p in set(engine.params))


@pytest.mark.parametrize("mode", ("bookkeeping", "per_sample"))
def test_per_layer_clipping_matches_brute_force(mode):
    model, _ = load_model("tiny-llama", head="causal_lm")
    check_against_brute_force(model, masked_batch("causal_lm"), mode, clipping_layout="per_layer")


def test_ghost_refuses_per_layer_clipping():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    with pytest.raises(UserError, match="per-layer"):
        make_engine(model, "ghost", clipping_layout="per_layer")


def test_mean_reduction_and_micro_batches_add_up():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    reference = copy.deepcopy(model)
    batch = masked_batch("causal_lm", batch=5)
    _, expected = brute_force(reference, lambda rows: losses(reference, batch, rows, "mean"), 5)
    engine = make_engine(model)
    for rows in (slice(0, 2), slice(2, 5)):  # one logical batch as two physical micro-batches
        engine.accumulate(losses(model, batch, rows, "mean"))
    assert_clipped_sums_match(model, engine, expected)


def test_step_divides_by_expected_batch_size_and_updates():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    reference = copy.deepcopy(model)
    batch = masked_batch("causal_lm")
    _, expected = brute_force(reference, lambda rows: losses(reference, batch, rows), 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, sample_rate=0.1,
                           dataset_size=100, verify=False)  # B = 10, the realised batch has 4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.step(losses(model, batch))
    for name, param in model.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), expected[name] / 10, rtol=1e-4, atol=1e-7)
        assert param.grad is None
    assert engine.steps == 1


def test_empty_batch_is_a_noise_only_step_with_the_right_scale():
    """Zero gradient: the privatized gradient is N(0, σ²C²)/B; its empirical std must be σC/B."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 20000))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sigma, clip, expected_batch = 1.3, 0.7, 8.0
    engine = PrivacyEngine(model, optimizer, noise_multiplier=sigma, max_grad_norm=clip,
                           expected_batch_size=expected_batch, dataset_size=80, seed=3, verify=False)
    engine.accumulate(torch.zeros(0))  # an empty Poisson batch
    noisy = torch.cat([g.flatten() for g in engine.dp_optimizer.privatized_grads().values()])
    n = noisy.numel()
    target = sigma * clip / expected_batch
    assert abs(float(noisy.std()) / target - 1) < 4 / math.sqrt(2 * n)  # 4 standard errors of a std
    assert abs(float(noisy.mean())) < 4 * target / math.sqrt(n)
    engine.step()
    assert engine.steps == 1


def test_zero_gradient_examples_get_noise_of_the_right_scale():
    model = nn.Sequential(nn.Linear(3, 30000))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=4,
                           dataset_size=40, seed=1, verify=False)
    out = model(torch.randn(4, 3))
    engine.accumulate(0 * out.sum(dim=1))
    noisy = torch.cat([g.flatten() for g in engine.dp_optimizer.privatized_grads().values()])
    assert abs(float(noisy.std()) / (2.0 * 0.5 / 4) - 1) < 4 / math.sqrt(2 * noisy.numel())


def test_calibrating_to_a_target_needs_an_accountant_that_bounds():
    model = nn.Linear(3, 2)

    def engine(accountant: str) -> PrivacyEngine:
        return PrivacyEngine.from_target_epsilon(model, torch.optim.SGD(model.parameters(), lr=0.1), target_epsilon=3.0,
                                                 delta=1e-5, steps=100, max_grad_norm=1.0, sample_rate=0.01,
                                                 dataset_size=1000, accountant=accountant, verify=False)

    with pytest.raises(UserError, match="approximation"):  # σ from the CLT would not make ε ≤ 3 a guarantee
        engine("gdp")
    calibrated = engine("rdp")
    calibrated.steps = 100  # as if it had taken the planned steps
    assert calibrated.epsilon(1e-5, "rdp") == pytest.approx(3.0, rel=1e-3) and calibrated.epsilon(1e-5) <= 3.0


def test_seeded_noise_repeats_and_secure_noise_does_not():
    def noise(**kwargs):
        model = nn.Linear(5, 5)
        engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
                               max_grad_norm=1.0, expected_batch_size=2, dataset_size=10, **kwargs, verify=False)
        return engine.dp_optimizer.privatized_grads()[model.weight]

    torch.testing.assert_close(noise(seed=7), noise(seed=7))
    assert not torch.equal(noise(secure_rng=True), noise(secure_rng=True))
    with pytest.raises(UserError, match="secure_rng"):
        noise(seed=1, secure_rng=True)


def test_ledger_hook_gets_each_step():
    calls = []
    model = nn.Linear(2, 2)
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                           max_grad_norm=1.0, sample_rate=0.01, dataset_size=1000,
                           ledger=lambda **event: calls.append(event), verify=False)
    engine.step()
    engine.step()
    assert calls == [{"sample_rate": 0.01, "noise_multiplier": 1.0}] * 2
    assert engine.accounting()["steps"] == 2


class Scale(nn.Module):
    """A trainable layer with no rule."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return torch.tanh(x) * self.gain


def test_unsupported_layer_is_refused_before_step_zero_naming_it():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    for mode in ("bookkeeping", "ghost"):
        with pytest.raises(UserError, match=r"Layer '1' \(Scale\).*freeze it.*per_sample"):
            make_engine(model, mode)


def test_per_sample_mode_handles_a_ruleless_layer_with_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    reference = copy.deepcopy(model)
    _, expected = brute_force(reference, lambda rows: (reference(x[rows]) - y[rows]).pow(2).sum(1), 4)
    engine = make_engine(model, "per_sample")
    engine.accumulate((model(x) - y).pow(2).sum(1))
    assert_clipped_sums_match(model, engine, expected)


def test_optimizer_with_foreign_parameters_is_refused():
    model = nn.Linear(2, 2)
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(UserError, match="not a trainable parameter"):
        PrivacyEngine(model, torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=2, dataset_size=10, verify=False)


def test_batch_averaged_loss_is_refused():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    engine = make_engine(model)
    batch = masked_batch("causal_lm")
    with pytest.raises(UserError, match="one loss per example"):
        engine.accumulate(losses(model, batch).mean())


def test_detach_gives_parameters_back_to_autograd():
    model, _ = load_model("tiny-gpt2", head="causal_lm")
    engine = make_engine(model)
    assert not any(p.requires_grad for p in model.parameters())
    engine.detach()
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_keeps_norms_close(mode):
    """Under autocast the layers compute in bf16; norms still agree with a bf16 brute force to bf16 accuracy."""
    model, _ = load_model("tiny-llama", head="causal_lm")
    batch = masked_batch("causal_lm")
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms, _ = brute_force(reference, lambda rows: losses(reference, batch, rows), 4)
        engine = make_engine(model, mode)
        got = engine.accumulate(losses(model, batch))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, norms, rtol=3e-2, atol=1e-3)
    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), engine._exact_arithmetic():
        assert torch.mm(x, x).dtype == torch.float32  # the norms' matmuls are not lowered to bf16
    assert all(s.dtype == torch.float32 for s in engine.clipped_grads().values())
