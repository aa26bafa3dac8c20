"""Tiny random Hugging Face architectures and the brute-force check the architecture matrix runs on them.

Shared by ``tests/test_arch_matrix.py`` and ``benchmarks/arch_table.py`` (which writes the supported-
architectures table of docs/privacy_engine.md from the same checks), so the table and the tests cannot drift.

Every model is built in code from a config (no hub): fp64, 2 layers, hidden 16, vocabulary 99, dropout off.
A *cell* is (architecture, clipping mode, layout, situation); ``run_cell`` builds the model, runs the engine
on one batch and compares its per-example norms and clipped sums with a loop over batches of one example.
Its outcome is "exact", "refused: <the UserError sentence>" or an AssertionError (wrong / crashed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from dptext.errors import UserError
from dptext.privacy import PrivacyEngine, per_example_loss
from test_privacy_engine import brute_force as loop_brute_force

VOCAB = 99
WIDTH = 16
CLIP = 0.05  # small enough that every example is clipped: exercises the coefficients, not just the norms
RTOL = 1e-6
FP32_RTOL = 1e-4  # an fp32 model against fp32 brute force: rounding only (a missed path is off by O(1))
MODES = ("bookkeeping", "ghost", "per_sample")
LAYOUTS = ("all_layer", "per_layer")

# Sizes most configs accept under these names (HF attribute maps translate them for GPT-2, Bloom, ...).
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout=0.0,
                  dropout_rate=0.0, classifier_dropout=0.0, summary_first_dropout=0.0)
SEQ2SEQ = dict(d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_start_token_id=2)


@dataclass(frozen=True)
class Arch:
    """One architecture: its HF model type, the head class (by name) and config overrides."""

    name: str
    model_type: str
    head: str  # a transformers class name, e.g. "LlamaForCausalLM"
    config: dict = field(default_factory=dict)
    family: str = "decoder"  # decoder | encoder | encoder-decoder
    # fp64 unless the model's own backward is not finite there (Longformer: its softmax runs in fp32, where the
    # fp64 mask value finfo(float64).min becomes -inf, and padded rows give NaN gradients even by plain autograd)
    dtype: torch.dtype = torch.float64

    @property
    def rtol(self) -> float:
        return RTOL if self.dtype == torch.float64 else FP32_RTOL

    @property
    def task(self) -> str:
        if self.head.endswith("ForSequenceClassification"):
            return "classification"
        if self.head.endswith("ForMaskedLM"):
            return "masked_lm"
        return "seq2seq" if self.family == "encoder-decoder" else "causal_lm"


def _arch(name, model_type, head, family="decoder", dtype=torch.float64, **config):
    return Arch(name, model_type, head, config, family, dtype)


ARCHS = [
    # decoders, causal LM
    _arch("gpt2", "gpt2", "GPT2LMHeadModel"),
    _arch("llama", "llama", "LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=True),
    _arch("mistral", "mistral", "MistralForCausalLM", num_key_value_heads=1),
    _arch("qwen2", "qwen2", "Qwen2ForCausalLM", num_key_value_heads=1),
    _arch("qwen3", "qwen3", "Qwen3ForCausalLM", num_key_value_heads=1, head_dim=8),
    _arch("gpt_neox", "gpt_neox", "GPTNeoXForCausalLM"),
    _arch("phi", "phi", "PhiForCausalLM"),
    _arch("phi3", "phi3", "Phi3ForCausalLM", num_key_value_heads=2),
    _arch("olmo2", "olmo2", "Olmo2ForCausalLM"),
    _arch("bloom", "bloom", "BloomForCausalLM", n_head=2),
    _arch("gemma", "gemma", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8),
    _arch("gemma2", "gemma2", "Gemma2ForCausalLM", num_key_value_heads=1, head_dim=8),
    _arch("gemma3_text", "gemma3_text", "Gemma3ForCausalLM", num_key_value_heads=1, head_dim=8),
    _arch("falcon", "falcon", "FalconForCausalLM", new_decoder_architecture=False, multi_query=True),
    _arch("opt", "opt", "OPTForCausalLM", ffn_dim=32, word_embed_proj_dim=WIDTH),
    _arch("cohere", "cohere", "CohereForCausalLM", num_key_value_heads=1),
    _arch("biogpt", "biogpt", "BioGptForCausalLM", scale_embedding=True),
    _arch("stablelm", "stablelm", "StableLmForCausalLM", num_key_value_heads=1),
    _arch("starcoder2", "starcoder2", "Starcoder2ForCausalLM", num_key_value_heads=1),
    _arch("gptj", "gptj", "GPTJForCausalLM", n_positions=64, rotary_dim=4),
    _arch("mixtral", "mixtral", "MixtralForCausalLM", num_key_value_heads=1, num_local_experts=4,
          num_experts_per_tok=2),
    _arch("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM", num_key_value_heads=1, num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    # decoders, sequence classification
    _arch("llama-cls", "llama", "LlamaForSequenceClassification", num_key_value_heads=1, num_labels=3),
    _arch("gpt2-cls", "gpt2", "GPT2ForSequenceClassification", num_labels=3),
    # encoders
    _arch("bert", "bert", "BertForMaskedLM", "encoder"),
    _arch("bert-cls", "bert", "BertForSequenceClassification", "encoder", num_labels=3),
    _arch("roberta", "roberta", "RobertaForMaskedLM", "encoder"),
    _arch("distilbert", "distilbert", "DistilBertForMaskedLM", "encoder", dim=WIDTH, hidden_dim=32, n_heads=2,
          n_layers=2),
    _arch("albert", "albert", "AlbertForMaskedLM", "encoder", embedding_size=8),
    _arch("electra", "electra", "ElectraForMaskedLM", "encoder", embedding_size=WIDTH),
    _arch("deberta_v2", "deberta-v2", "DebertaV2ForMaskedLM", "encoder", relative_attention=True,
          position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16),
    _arch("deberta_v2-cls", "deberta-v2", "DebertaV2ForSequenceClassification", "encoder", num_labels=3,
          relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16),
    _arch("deberta_v3", "deberta-v2", "DebertaV2ForMaskedLM", "encoder", relative_attention=True,
          position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16, share_att_key=True,
          norm_rel_ebd="layer_norm"),  # DeBERTa-v3's settings: the content projections also project positions
    _arch("mpnet", "mpnet", "MPNetForMaskedLM", "encoder",),
    _arch("longformer", "longformer", "LongformerForMaskedLM", "encoder", dtype=torch.float32,
          attention_window=[4, 4]),
    _arch("xlm_roberta", "xlm-roberta", "XLMRobertaForMaskedLM", "encoder"),
    # encoder-decoders
    _arch("t5", "t5", "T5ForConditionalGeneration", "encoder-decoder", d_model=WIDTH, d_ff=32, d_kv=8, num_layers=2,
          num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0),
    _arch("bart", "bart", "BartForConditionalGeneration", "encoder-decoder", scale_embedding=True, **SEQ2SEQ),
    _arch("mbart", "mbart", "MBartForConditionalGeneration", "encoder-decoder", scale_embedding=True, **SEQ2SEQ),
]
BY_NAME = {arch.name: arch for arch in ARCHS}


def build(arch: Arch, seed: int = 0) -> nn.Module:
    """The tiny model (fp64 unless ``arch.dtype`` says otherwise), deterministically initialised, in eval mode."""
    settings = {**COMMON, **NO_DROPOUT, **arch.config}
    config = transformers.AutoConfig.for_model(arch.model_type, **settings)
    torch.manual_seed(seed)
    model = getattr(transformers, arch.head)(config).to(arch.dtype).eval()
    model.config._experts_implementation = "eager"  # grouped_mm (the default for MoE experts) has no fp64 kernel
    with torch.no_grad():  # HF zero-initialises some biases and norms; random values exercise every term
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


@dataclass
class Situation:
    """How the batch looks: size, length, right/left padding, and which parameters are trainable."""

    name: str
    batch: int = 3
    length: int = 7
    padding: str = "right"  # right | left | none
    adapters: str = "full"  # full | lora | dora | top2


SITUATIONS = {
    "default": Situation("default"),
    "batch_eq_length": Situation("batch_eq_length", batch=4, length=4),  # also Longformer's window: no padding
    "single_token": Situation("single_token", batch=3, length=1, padding="none"),
    "left_padding": Situation("left_padding", padding="left"),
    "lora": Situation("lora", adapters="lora"),
    "dora": Situation("dora", adapters="dora"),
    "top2": Situation("top2", adapters="top2"),
}


def make_batch(arch: Arch, situation: Situation, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    batch, length = situation.batch, situation.length
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    if situation.padding != "none":
        for i in range(1, batch):  # example 0 is full length, the others shorter
            keep = max(1, length - 2 * i)
            if situation.padding == "right":
                mask[i, keep:] = 0
            else:
                mask[i, :length - keep] = 0
    ids[mask == 0] = 0
    result = {"input_ids": ids, "attention_mask": mask}
    if arch.task == "classification":
        result["labels"] = torch.randint(0, 3, (batch,), generator=generator)
    elif arch.task == "seq2seq":
        targets = torch.randint(3, VOCAB, (batch, max(2, length - 1)), generator=generator)
        result["decoder_input_ids"] = torch.cat([torch.full((batch, 1), 2), targets[:, :-1]], dim=1)
        result["labels"] = targets
    else:
        labels = ids.clone()
        labels[mask == 0] = -100
        if arch.task == "masked_lm" and length > 1:
            labels[:, ::2] = -100
        result["labels"] = labels
    return result


def losses(model: nn.Module, batch: dict, rows=slice(None)) -> torch.Tensor:
    """(b,) per-example losses of ``batch[rows]``."""
    inputs = {key: value[rows] for key, value in batch.items() if key != "labels"}
    labels = batch["labels"][rows]
    logits = model(**inputs).logits
    if logits.ndim == 2:
        return F.cross_entropy(logits, labels, reduction="none")
    mask = None if "decoder_input_ids" in batch else inputs["attention_mask"]
    causal = not ("decoder_input_ids" in batch or labels.shape != inputs["input_ids"].shape or
                  model.__class__.__name__.endswith("ForMaskedLM"))
    return per_example_loss(logits, labels, mask, shift=causal)


def prepare(model: nn.Module, situation: Situation) -> nn.Module:
    """Freeze or wrap the model as the situation says (LoRA on every Linear-like block projection; top-2)."""
    if situation.adapters in ("lora", "dora"):
        import peft

        targets = [name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (nn.Linear, Conv1D)) and ".0." in name]
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=sorted(set(targets))[:3], lora_dropout=0.0,
                                 init_lora_weights=False, use_dora=situation.adapters == "dora")
        return peft.get_peft_model(model, config).to(next(model.parameters()).dtype)
    if situation.adapters == "top2":
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params[:-2]:
            param.requires_grad_(False)
    return model


def brute_force(model, batch, size, per_layer):
    """Per-example gradients by a loop over batches of one: (norms, {name: clipped sum})."""
    return loop_brute_force(model, lambda rows: losses(model, batch, rows), size, CLIP, per_layer)


def engine_result(model, batch, mode, layout):
    """The engine's (norms, {name: clipped sum}); raises UserError where it refuses."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=4,
                           dataset_size=100, clipping_mode=mode, clipping_layout=layout, verify=False)
    try:
        norms = engine.accumulate(losses(model, batch))
        got = engine.clipped_grads()
        return norms, {name: got.get(param) for name, param in model.named_parameters() if param in got}
    finally:
        engine.detach()


def compare(norms, expected, got_norms, got, rtol: float = RTOL) -> list[str]:
    """Relative errors above ``rtol``, one line per offending parameter (empty: exact)."""
    problems = []
    norm_error = float(((got_norms.double() - norms).abs() / norms.clamp(min=1e-12)).max())
    if norm_error > rtol:
        problems.append(f"per-example norms: relative error {norm_error:.2e}")
    scale = max(float(e.abs().max()) for e in expected.values())
    for name, value in expected.items():
        mine = got.get(name)
        if mine is None:
            if float(value.abs().max()) > rtol * scale:
                problems.append(f"{name}: no clipped sum (brute force max |g| {float(value.abs().max()):.2e})")
            continue
        error = float((mine.double() - value).abs().max())
        if error > rtol * max(float(value.abs().max()), scale * 1e-3):
            problems.append(f"{name}: max abs error {error:.2e} (max |g| {float(value.abs().max()):.2e})")
    return problems


def run_cell(arch: Arch, mode: str, layout: str = "all_layer", situation: str = "default") -> str:
    """"exact" or "refused: <sentence>"; raises AssertionError listing each wrong parameter."""
    where = SITUATIONS[situation]
    if mode == "ghost" and layout == "per_layer":
        return "refused: ghost clipping applies one factor per example (all-layer only)"
    model = prepare(build(arch), where)
    batch = make_batch(arch, where)
    reference = copy.deepcopy(model)
    norms, expected = brute_force(reference, batch, where.batch, layout == "per_layer")
    finite = bool(torch.isfinite(norms).all())  # False: the model's own gradients (e.g. transformers' bloom and
    try:                                          # gemma2 on left-padded rows) are NaN, and the engine must refuse
        got_norms, got = engine_result(model, batch, mode, layout)
    except UserError as error:
        return f"refused: {error}" if finite else f"not finite: {error}"
    assert finite, f"{arch.name} {situation}: the engine accepted a batch whose brute-force gradients are not finite"
    problems = compare(norms, expected, got_norms, got, arch.rtol)
    assert not problems, f"{arch.name} {mode} {layout} {situation} differs from brute force:\n" + "\n".join(problems)
    return "exact"
