"""The second red team of session 23 (issue 42): ways a model whose clipping is inexact, or whose training releases
batch statistics, could end up proven — each refused now.

1. A layer below a zero-initialised gate (LoRA's B, ReZero, adapters) had gradient 0 on the probe's batch, so its
   rule was never compared ("not reached", accepted): all-zero trained tensors are re-drawn for the probe.
2. ``engine.verify()`` on a model in eval mode proved the eval forward, and training then ran the training one:
   the proof records the train/eval flags it ran in and is made again when a training forward runs in others.
3. Running statistics kept in a frozen ``nn.Parameter`` (not a buffer) were not looked at.
4. A probe that compared nothing (a zero loss, no shapes) verified the engine; a proof made for one clipping mode or
   layout was adopted by another.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.errors import UserError
from dptext.models import load_model
from dptext.privacy import PrivacyEngine
from dptext.privacy.proof import verify as verify_module
from test_proof_patterns import MixRows  # identity forward, a backward that mixes examples
from test_proof_stack import DeepStack, engine_for


class Gated(nn.Module):
    """h + b(mix(tanh(a(h)))) with ``b`` zero-initialised: on the probe's batch ``a`` gets no gradient at all."""

    def __init__(self, mix=True, vocab=13, width=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        nn.init.zeros_(self.b.weight)
        nn.init.zeros_(self.b.bias)
        self.head = nn.Linear(width, vocab)
        self.mix = mix

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        inner = torch.tanh(self.a(self.embed(input_ids)))
        h = self.embed(input_ids) + self.b(MixRows.apply(inner) if self.mix else inner)
        return self.head(torch.tanh(h))


def test_a_layer_below_a_zero_gate_is_compared_and_a_mix_there_refused():
    model = Gated().double()
    with pytest.raises(UserError, match="refused"):
        engine_for(model).verify()
    assert not bool(model.b.weight.any()) and not bool(model.b.bias.any())  # the gate is zero again after


def test_a_clean_zero_gate_is_proven_exact_and_left_at_zero():
    model = Gated(mix=False).double()
    report = engine_for(model).verify()
    assert report.rows[model.a].status == "exact"  # compared, not "not reached"
    assert not bool(model.b.weight.any())


def test_lora_a_under_a_zero_lora_b_is_compared():
    from peft import LoraConfig, get_peft_model

    base = load_model("tiny-llama", head="causal_lm")[0].train()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, bias="none"))
    report = engine_for(model).verify()
    lora_a = [row for row in report.rows.values() if "lora_A" in row.name]
    assert lora_a and {row.status for row in lora_a} == {"exact"}
    assert all(not bool(m.weight.any()) for n, m in model.named_modules() if n.endswith("lora_B.default"))


class WithBatchNorm(nn.Module):
    """A frozen BatchNorm: in training mode its batch statistics mix examples and its running statistics move."""

    def __init__(self, vocab=13, width=6):
        super().__init__()
        self.embed, self.bn, self.head = nn.Embedding(vocab, width), nn.BatchNorm1d(width), nn.Linear(width, vocab)
        self.bn.requires_grad_(False)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.head(self.bn(h.reshape(-1, h.shape[-1])).reshape(h.shape))


def test_a_proof_made_in_eval_mode_is_made_again_before_training_in_train_mode():
    model = WithBatchNorm().double().eval()
    shapes = []  # (the spy hook is registered before the engine: one added after its plan is refused by verify())
    model.head.register_forward_hook(lambda module, args, output: shapes.append(tuple(args[0].shape[:2])))
    engine = engine_for(model)
    engine.verify()  # the eval forward: nothing mixes, nothing moves
    model.train()
    shapes.clear()
    private = torch.randint(1, 13, (2, 7))  # a shape none of the probe's synthetic batches has
    with pytest.raises(UserError, match="refused"):  # the training forward is proven first, and refused
        verify_module.output_functional_loss(model, {"input_ids": private})
    assert shapes and (2, 7) not in shapes  # the probe ran; the private batch never reached the model's head


def test_the_probe_restores_each_modules_own_mode():
    model = DeepStack().double().train()
    model.layers[1].eval()  # e.g. a frozen part the user keeps in eval mode
    engine_for(model).verify()
    assert model.training and not model.layers[1].training and model.layers[0].training


class Statistics(nn.Module):
    """An EMA of the batch's mean in a frozen parameter (or a buffer), used only in eval mode."""

    def __init__(self, as_buffer, through_data=False, vocab=13, width=6):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        if as_buffer:
            self.register_buffer("running_mean", torch.zeros(width))
        else:
            self.running_mean = nn.Parameter(torch.zeros(width), requires_grad=False)
        self.through_data = through_data

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if not self.training:
            return self.head(h - self.running_mean)
        with torch.no_grad():
            target = self.running_mean.data if self.through_data else self.running_mean
            target.mul_(0.9).add_(0.1 * h.mean((0, 1)))
        return self.head(h)


@pytest.mark.parametrize("as_buffer, through_data", [(True, False), (False, False), (False, True)])
def test_running_statistics_in_a_buffer_or_a_frozen_parameter_are_refused(as_buffer, through_data):
    with pytest.raises(UserError, match="running_mean"):
        engine_for(Statistics(as_buffer, through_data).double()).verify()


@pytest.mark.parametrize("how", ["zero loss", "no shapes"])
def test_a_probe_that_compared_nothing_proves_nothing(how):
    model = DeepStack(mix_at=1, backward_only=True).double()  # the default probe refuses it
    engine = engine_for(model)
    options = {"loss_fn": lambda m, b: verify_module.output_functional_loss(m, b) * 0} if how == "zero loss" \
        else {"shapes": ()}
    with pytest.raises(UserError, match="compared no layer"):
        engine.verify(**options)
    assert not engine.verified


@pytest.mark.parametrize("mode, layout", [("ghost", "all_layer"), ("bookkeeping", "per_layer")])
def test_a_proof_is_adopted_only_by_an_engine_with_its_clipping_settings(mode, layout):
    model = DeepStack().double()
    first = engine_for(model, mode="per_sample")
    report = first.verify()
    first.detach()
    with pytest.raises(UserError, match="proved for clipping"):
        PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=0.05,
                      expected_batch_size=4, dataset_size=100, clipping_mode=mode, clipping_layout=layout,
                      verify=report)
    same = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                         max_grad_norm=0.05, expected_batch_size=4, dataset_size=100, clipping_mode="per_sample",
                         verify=report)
    assert same.verified


def test_rows_are_compared_layer_by_layer_when_a_redraw_changes_which_layers_run():
    """The re-draw check pairs each layer's k-th recorded input before and after: an extra call at the start (a
    layer run only for some tokens) once shifted the pairs by one, and every row check after it was skipped."""
    from types import SimpleNamespace

    from dptext.privacy.proof.independence import ROWS_INTERACT, check_redrawn_examples

    gate, mixed = nn.Linear(2, 2), nn.Linear(2, 2)
    rows = torch.arange(8.0).reshape(4, 2)
    moved = rows.clone()
    moved[1] += 1  # re-drawing example 0 moves example 1's row of ``mixed``'s input: rows are not examples
    recorder = SimpleNamespace(uses=[], probing=False)
    recorder.take_uses = lambda: recorder.uses.clear()
    engine = SimpleNamespace(recorder=recorder, model=None)
    report = SimpleNamespace(refused_layers=[], loss_problem=None)
    report.refuse = lambda module, why: report.refused_layers.append((module, why))

    def loss_fn(model, batch):  # the redraw runs ``gate`` first, then ``mixed``
        recorder.uses[:] = [SimpleNamespace(module=gate, activation=(rows[:, :1].expand(4, 2),)),
                            SimpleNamespace(module=mixed, activation=(moved,))]
        return torch.zeros(4)

    check_redrawn_examples(engine, report, lambda example: {}, loss_fn, torch.device("cpu"), torch.zeros(4),
                           [(mixed, rows)])
    assert (mixed, ROWS_INTERACT) in report.refused_layers


def test_a_proof_adopted_with_verify_carries_its_train_eval_flags():
    """The third red team: ``verify=report`` left the flags unknown, so a proof of the eval forward, adopted, then
    ``model.train()``, trained a BatchNorm on batch statistics while the engine said clipping verified."""
    model = WithBatchNorm().double().eval()
    first = engine_for(model)
    report = first.verify()
    first.detach()
    engine = PrivacyEngine(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                           noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=4, dataset_size=100,
                           verify=report)
    assert engine.proven_modes == report.modes
    model.train()
    with pytest.raises(UserError, match="running_mean|interact"):
        engine.step(verify_module.output_functional_loss(model, {"input_ids": torch.randint(1, 13, (4, 7))}))


class EvalsItsBatchNorm(WithBatchNorm):
    def forward(self, input_ids, attention_mask=None):
        self.bn.eval()  # the flags change during the first forward, after the proof
        return super().forward(input_ids, attention_mask)


def test_flags_that_change_inside_a_logical_batch_are_refused_with_a_sentence():
    """A proof between two micro-batches would add its synthetic sums to the batch's (and drop the first's)."""
    model = EvalsItsBatchNorm().double().train()
    engine = engine_for(model)
    engine.accumulate(verify_module.output_functional_loss(model, {"input_ids": torch.randint(1, 13, (4, 7))}))
    with pytest.raises(UserError, match="inside a logical batch"):
        engine.accumulate(verify_module.output_functional_loss(model, {"input_ids": torch.randint(1, 13, (4, 7))}))


def test_evaluation_gives_each_module_its_own_flag_back():
    """Evaluation restored the root's flag to every module, putting a BatchNorm kept in eval mode back in training."""
    from dptext.models.modes import evaluating

    model = WithBatchNorm().train()
    model.bn.eval()
    with evaluating(model):
        assert not model.training and not model.head.training
    assert model.training and model.head.training and not model.bn.training


def test_a_model_that_replaces_its_own_modules_in_the_probes_forward_is_refused_in_one_sentence():
    """Red team (session 24): BigBird swaps its block-sparse attention for full attention on short sequences, in
    the probe's forward; restoring the train/eval flags then failed with a bare ValueError."""
    import transformers

    def bigbird(attention_type):
        config = transformers.BigBirdConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=128, block_size=2,
                                            num_random_blocks=1, attention_type=attention_type)
        model = transformers.BigBirdForMaskedLM(config).train()
        return PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                             max_grad_norm=0.05, expected_batch_size=4, dataset_size=100, verify=False)

    with pytest.raises(UserError, match="replaced some of its own modules"):
        bigbird("block_sparse").verify()
    report = bigbird("original_full").verify()
    assert any(row.status == "exact" for row in report.rows.values())
