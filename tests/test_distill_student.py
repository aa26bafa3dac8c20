"""Layer-subset students: weights from the right teacher layers, ties kept, forward equals the skipped-layer twin."""

from __future__ import annotations

import pytest
import torch

from dptext.distill.student import build_student, layer_indices, layer_subset
from dptext.errors import UserError
from dptext.models import load_model


def test_layer_indices():
    assert layer_indices(30, stride=3) == [2, 5, 8, 11, 14, 17, 20, 23, 26, 29]
    assert layer_indices(4, stride=2) == [1, 3]
    assert layer_indices(4, layers=[0, 3]) == [0, 3]
    assert layer_indices(4) == [0, 1, 2, 3]
    for bad in ([3, 1], [0, 0], [4], [-1]):
        with pytest.raises(UserError):
            layer_indices(4, layers=bad)


def test_gpt2_subset_copies_the_chosen_layers_and_matches_a_skipping_forward():
    source, _ = load_model("tiny-gpt2", head="causal_lm", n_layer=4)
    student = layer_subset(source, [1, 3])
    assert student.config.n_layer == 2 and len(student.transformer.h) == 2
    for new, old in enumerate([1, 3]):
        for (name, p_new), (_, p_old) in zip(student.transformer.h[new].named_parameters(),
                                             source.transformer.h[old].named_parameters()):
            assert torch.equal(p_new, p_old), name
    for name in ("wte", "wpe", "ln_f"):
        for p_new, p_old in zip(getattr(student.transformer, name).parameters(),
                                getattr(source.transformer, name).parameters()):
            assert torch.equal(p_new, p_old)
    assert student.lm_head.weight is student.transformer.wte.weight  # still tied: one tensor
    assert student.transformer.wte.weight.data_ptr() != source.transformer.wte.weight.data_ptr()  # a copy
    # brute-force twin: the source model run through layers 1 and 3 only
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = source.transformer.wte(ids) + source.transformer.wpe(torch.arange(9))[None]
        for layer in (1, 3):
            out = source.transformer.h[layer](hidden)
            hidden = out[0] if isinstance(out, tuple) else out
        want = source.lm_head(source.transformer.ln_f(hidden))
        got = student(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llama_subset_keeps_ties_and_runs(tmp_path):
    source, tokenizer = load_model("tiny-llama", head="causal_lm")
    student = layer_subset(source, [1])
    assert student.config.num_hidden_layers == 1
    for p_new, p_old in zip(student.model.layers[0].parameters(), source.model.layers[1].parameters()):
        assert torch.equal(p_new, p_old)
    assert torch.equal(student.model.norm.weight, source.model.norm.weight)
    assert student.lm_head.weight is student.model.embed_tokens.weight
    ids = tokenizer("Category: books || Rating: 4\nGreat.", return_tensors="pt")["input_ids"]
    logits = student(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    # training moves the one shared tensor, so the head follows the embedding
    logits.sum().backward()
    assert student.model.embed_tokens.weight.grad is not None


def test_build_student_saves_a_loadable_folder(tmp_path):
    model, _, description = build_student("tiny-llama", layers=[1], target=tmp_path / "student")
    assert description["layers"] == [1] and description["source_layers"] == 2
    assert description["parameters"] == sum(p.numel() for p in model.parameters())
    reloaded, _ = load_model(str(tmp_path / "student"), head="causal_lm")
    assert reloaded.config.num_hidden_layers == 1
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def test_hidden_state_term_needs_matching_sizes():
    from dptext import config
    from dptext.distill.task import DistillationTask

    teacher, tokenizer = load_model("tiny-llama", head="causal_lm")
    wider, _ = load_model("tiny-llama", head="causal_lm", hidden_size=64, intermediate_size=128)
    recipe = config.load_recipe(None, ["distill.hidden_alpha=0.4"])
    task = DistillationTask(recipe, tokenizer, teacher)
    task.check_hidden_sizes(layer_subset(teacher, [0]))  # same width: fine
    with pytest.raises(UserError):
        task.check_hidden_sizes(wider)


def test_distillation_task_against_itself_is_scaled_cross_entropy():
    """A student identical to its teacher has KL = 0 and MSE = 0: the task's loss is (1 − λ)·CE exactly."""
    from dptext import config
    from dptext.distill.task import DistillationTask
    from dptext.tasks.language_modeling import LanguageModelingTask

    teacher, tokenizer = load_model("tiny-llama", head="causal_lm")
    recipe = config.load_recipe(None, ["distill.kd_lambda=0.4", "distill.hidden_alpha=0.3", "data.max_length=32",
                                       "task.control_codes=[category, rating]"])
    records = [{"category": "books", "rating": 5, "text": "A fine read."},
               {"category": "dvd", "rating": 1, "text": "Dull and far too long, skip it."}]
    plain = LanguageModelingTask(recipe, tokenizer)
    batch = plain.collate(plain.encode(records))
    task = DistillationTask(recipe, tokenizer, teacher)
    student = layer_subset(teacher, [0, 1])  # an exact copy
    with torch.no_grad():
        got = task.per_example_loss(student, batch)
        want = 0.6 * plain.per_example_loss(teacher, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
