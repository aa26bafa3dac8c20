"""Red team of the sharded probe's vocabulary cut (``proof.vocabulary.sharded_cut``; issue 42). 2 gloo processes (and 3
for a cut that straddles the ranks' rows).

Each case runs on every rank with the cut and without it (``verify.sharded_cut`` giving None: the whole vocabulary, as
before the cut), and in one process (the test process): the verdicts must be the same three times; the cut must have
been applied where the test says so; after the probe (accepted, refused, or fallen back to the whole vocabulary) the
shards hold what they held, FSDP2's registered unsharded parameters, the modules' sizes and the config are whole, and
the DP step after it gives bit for bit the weights the step after the uncut probe gives (and, within rounding, the
one-process step's). Cases: an untied head with a (zero, re-drawn) bias; an untied embedding and head each in an FSDP2
unit of its own (resharded after its forward, its gathered storage freed: the cut crashed there with torch's raw error,
``vocabulary.first_rows``), also with Adam (the probe then serves those units' gathers from its copies); an embedding
with a padding row; a vocabulary not divisible by the ranks; a V-sized buffer the forward adds to the logits (fails on
the cut: the whole vocabulary is proven); a backward that fails on the cut mid-way through FSDP2's (the whole vocabulary
proven after it: FSDP2's state must be reset, ``fsdp_controls.reset_after_failure``, or every layer was refused); a
refusal raised inside the cut shape's loss, and one raised inside its backward (FSDP2 must be idle after it, or the
model's next engine and training start inside that backward); FSDP2's bf16 policy; two wrong rules seen at B = T only,
one of them writing junk into the last row of a sum sized by the module's weight (under FSDP2 the shard's V rows at sum
time: rank 1's rows beyond the cut, which ``sum_error`` must count); 3 ranks with a 70-token vocabulary (rank 1's rows
straddle the cut).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn
from test_fsdp_redteam import outcome
from two_ranks import CASES_VARIABLE, run_two_ranks

TIMEOUT = 400
VOCAB, WIDTH, ROWS = 4096, 16, 32  # ROWS: the cut (KEPT_ROWS is 16 in the tests: twice the width is kept)
TWO_RANK_CASES = ("bias_head", "padding", "odd_vocab", "logits_buffer", "backward_fails", "refused_in_cut",
                  "refused_in_backward", "bf16", "bt_bug", "beyond_bug", "own_units", "own_units_adam")
THREE_RANK_CASES = ("straddle",)


def build(case: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = {"odd_vocab": VOCAB + 3, "straddle": 70}.get(case, VOCAB)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=case not in UNTIED,
                         pad_token_id=0 if case == "padding" else None)
    cls = _biased_class() if case == "logits_buffer" else LlamaForCausalLM
    model = cls(config)
    if case in ("backward_fails", "refused_in_backward"):  # between the blocks, a backward that fails on the cut
        model.model.layers[0].register_forward_hook(  # (mid-way through FSDP2's)
            lambda module, args, out: FailsOnTheCut.apply(out, config, case == "refused_in_backward"))
    if case == "bias_head":
        model.lm_head = nn.Linear(WIDTH, vocab, bias=True)
        nn.init.zeros_(model.lm_head.bias)  # all zero: the probe re-draws it into the shards
    return model.double()


def _biased_class():
    """Llama adding a V-sized buffer to its logits (BART's ``final_logits_bias``): its forward fails on the cut."""
    from transformers import LlamaForCausalLM

    class Biased(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.register_buffer("final_logits_bias", torch.randn(1, config.vocab_size) * 0.01)

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            out.logits = out.logits + self.final_logits_bias  # (B, T, rows) + (1, V): fails on the cut
            return out

    return Biased


class FailsOnTheCut(torch.autograd.Function):
    """The identity, whose backward fails while the config says the vocabulary is cut."""

    @staticmethod
    def forward(ctx, hidden, config, refusal):
        ctx.cut, ctx.refusal = config.vocab_size < VOCAB, refusal
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        from dptext.errors import UserError

        if ctx.cut:
            raise (UserError if ctx.refusal else RuntimeError)("this backward does not run on the cut vocabulary")
        return grad, None, None


@contextmanager
def wrong_rule(case: str, seen: list):
    """``EmbeddingRule.add_clipped_sum`` (the tied embedding's rows added into the head's sum) wrong at B = T only:
    ``bt_bug`` takes the output gradient's positions for its examples; ``beyond_bug`` sizes its sum by the module's
    weight at sum time (one process: the cut matrix; FSDP2: the shard, V rows) and writes junk into its last row."""
    from dptext.privacy.norms.embedding import EmbeddingRule

    real = EmbeddingRule.add_clipped_sum

    def buggy(self, total, module, ids, grad_output, coef):
        square = ids.shape[0] == ids.shape[1]
        if square and case == "bt_bug":
            grad_output = grad_output.reshape(ids.shape[0], ids.shape[1], -1).transpose(0, 1)
        out = real(self, total, module, ids, grad_output, coef)
        if square and case == "beyond_bug":
            rows = module.weight.shape[0]
            seen.append(rows)
            out = torch.cat([out, out.new_zeros(rows - len(out), out.shape[1])]) if rows > len(out) else out
            out[-1] += 0.1 * float(coef.abs().max())
        return out

    if case in ("bt_bug", "beyond_bug"):
        EmbeddingRule.add_clipped_sum = buggy
    try:
        yield
    finally:
        EmbeddingRule.add_clipped_sum = real


def _full(param):
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def fsdp_state(model) -> dict:
    """Per FSDP2 parameter: its registered unsharded parameter's shape against its whole shape; the modules' and
    config's vocabulary sizes; every shard's local data (bit for bit)."""
    from dptext.privacy.proof.sharded_probe import unit_groups
    from dptext.privacy.sharding.fsdp_controls import fsdp_modules

    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    idle = all(unit._get_fsdp_state()._training_state == TrainingState.IDLE and all(
        group._training_state == TrainingState.IDLE for group in unit_groups(unit)) for unit in fsdp_modules(model))
    gathered = [(tuple(p._unsharded_param.shape), tuple(p._orig_size)) for unit in fsdp_modules(model)
                for group in unit_groups(unit) for p in group.fsdp_params if hasattr(p, "_unsharded_param")]
    sizes = [getattr(m, "num_embeddings", None) or getattr(m, "out_features", None)
             for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for name, p in model.named_parameters()}
    return {"idle": idle, "gathered": gathered, "sizes": sizes + [model.config.vocab_size], "local": local}


def run(case: str, ctx=None, cut: bool = True) -> dict:
    """The probe on ``case`` (its verdict and table, its notes, the logits' widths the loss saw), the state after
    it, and one DP step's whole weights after it."""
    from dptext.privacy import PrivacyEngine, causal_lm_loss
    from dptext.errors import UserError
    from dptext.privacy.proof import verify
    from dptext.privacy.proof.synthetic import output_functional_loss

    model = build(case)
    vocab = model.config.vocab_size
    if ctx is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from dptext.finetune.sharding import shard_model

        own = [model.model.embed_tokens, model.lm_head] if case in UNTIED[1:] else []  # (units of their own)
        shard_model(model, list(model.model.layers) + own,
                    policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "bf16" else None)
    before = fsdp_state(model) if ctx is not None else None
    widths, seen = [], []

    def loss(model, batch):
        out = model(**batch)
        widths.append(out.logits.shape[-1])
        if case == "refused_in_cut" and out.logits.shape[-1] < vocab:
            raise UserError("refused inside the cut shape")
        return output_functional_loss(lambda **_: out, batch)

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if case.endswith("adam") else \
        torch.optim.SGD(model.parameters(), lr=0.5)  # (Adam: the probe copies the gathers of units beside the root)
    engine = PrivacyEngine(model, optimizer, noise_multiplier=0.0,
                           max_grad_norm=1e-3, expected_batch_size=4, dataset_size=100, distributed=ctx, verify=False)
    real_cut = verify.sharded_cut
    if not cut:
        verify.sharded_cut = lambda planned, engine: None if getattr(engine, "probe_view", None) else planned
    reports = []

    real_probe = verify._probe

    def spied(*args, **kwargs):  # the report, also where engine.verify() refuses
        reports.append(real_probe(*args, **kwargs))
        return reports[-1]

    verify._probe = spied
    try:
        with wrong_rule(case, seen):
            verdict, words = outcome(lambda: engine.verify(loss_fn=loss))
    finally:
        verify.sharded_cut, verify._probe = real_cut, real_probe
    result = {"verdict": verdict, "words": words if verdict != "ok" else None, "widths": sorted(set(widths)),
              "seen": sorted(set(seen)),
              "table": {row["name"]: row["status"] for row in reports[0].table()} if reports else None,
              "notes": list(reports[0].notes) if reports else [], "probe_view": hasattr(engine, "probe_view")}
    if ctx is not None:
        after = fsdp_state(model)
        result["gathered"], result["idle"] = after["gathered"], after["idle"]
        result["sizes"] = after["sizes"]
        result["shards_kept"] = all(torch.equal(after["local"][name], local) for name, local in before["local"].items())
    ids = torch.randint(0, vocab, (6, 6), generator=torch.Generator().manual_seed(3))  # (6 examples: 2 or 3 ranks)
    if ctx is not None:
        share = 6 // ctx.world_size
        ids = ids[ctx.rank * share:(ctx.rank + 1) * share]
    if verdict == "ok":
        engine.step(causal_lm_loss(model(input_ids=ids).logits, ids))
    result["after"] = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    engine.detach()
    return result


def crashed(action, *args, **kwargs) -> dict:
    """``action``'s result, or its error in words (a probe that crashes instead of refusing: every rank alike here,
    so the other cases still run)."""
    try:
        return action(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the finding
        return {"verdict": f"crashed: {type(error).__name__}: {error}"}


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release
    from dptext.privacy.proof import vocabulary

    vocabulary.KEPT_ROWS = 16  # as tests/conftest.py sets it for the one-process probe
    ctx = current("cpu")
    ctx.sharded = True
    cases = THREE_RANK_CASES if ctx.world_size == 3 else TWO_RANK_CASES
    if os.environ.get(CASES_VARIABLE):  # (a debugging run of some cases)
        cases = os.environ[CASES_VARIABLE].split(",")
    results = {case: {"cut": crashed(run, case, ctx), "whole": crashed(run, case, ctx, cut=False)} for case in cases}
    torch.save(results, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks3"), TIMEOUT, ranks=3)


CUT = {"bias_head": True, "padding": True, "odd_vocab": True, "logits_buffer": False, "backward_fails": True,
       "refused_in_cut": True, "refused_in_backward": True,
       "bf16": True, "bt_bug": True, "beyond_bug": True, "straddle": True,
       "own_units": True, "own_units_adam": True}
UNTIED = ("bias_head", "own_units", "own_units_adam")
REFUSED_IN_CUT = ("refused_in_cut", "refused_in_backward")
FALLS_BACK = ("logits_buffer", "backward_fails")  # the forward (or backward) fails on the cut: proven whole
VERDICT = {"refused_in_cut": "refused", "refused_in_backward": "refused", "bt_bug": "refused", "beyond_bug": "refused"}


def check_case(case: str, ranks: list) -> None:
    one_process = run(case)
    vocab = build(case).config.vocab_size
    whole_shapes = [tuple(p.shape) for p in build(case).parameters()]
    for got in ranks:
        cut, whole = got[case]["cut"], got[case]["whole"]
        assert cut["verdict"] == one_process["verdict"] == VERDICT.get(case, "ok"), case
        if case in REFUSED_IN_CUT:  # (a refusal in the cut shape's loss or backward: the whole vocabulary never raises
            assert whole["verdict"] == "ok" and "cut" in cut["words"]  # it)
            for name, value in zip(cut["after"], build(case).parameters()):  # no step: the weights as built
                assert torch.equal(cut["after"][name], value.detach()), name
            whole = {**whole, "after": cut["after"]}
        else:
            assert whole["verdict"] == cut["verdict"], case
        if cut["verdict"] == "ok":
            assert cut["table"] == whole["table"] == one_process["table"], case
            assert cut["notes"] == whole["notes"] == one_process["notes"] if case not in FALLS_BACK else \
                cut["notes"] == one_process["notes"] and any("whole stack and vocabulary" in n for n in cut["notes"])
        elif case not in REFUSED_IN_CUT:  # a wrong rule: the probe refuses its layers (one process: the per-step
            assert cut["table"] == whole["table"], case  # invariant, which the sharded probe checks at the step)
            assert cut["table"]["model.embed_tokens"] == cut["table"]["lm_head"] == "refused", case
        assert cut["widths"] == ([ROWS, vocab] if CUT[case] else [vocab]), case  # the layers saw the cut (or not)
        assert whole["widths"] == [vocab], case
        for result in (cut, whole):  # the state after the probe: whole, the shards untouched
            assert not result["probe_view"] and result["shards_kept"] and result["idle"], case
            assert all(shape == orig for shape, orig in result["gathered"]), case
            assert result["sizes"] == [vocab, vocab, vocab], case
            assert [tuple(t.shape) for t in result["after"].values()] == whole_shapes, case
        for name, value in cut["after"].items():  # the step after the probe: as after the uncut probe, bit for bit
            assert torch.equal(value, whole["after"][name]), (case, name)
            if case not in ("bf16", "own_units_adam"):  # and as in one process (the bf16 policy rounds the sharded
                # step's forward; Adam's first step divides rounding by itself where a gradient is ~0)
                torch.testing.assert_close(value, one_process["after"][name], rtol=1e-6, atol=1e-12)
    if case == "beyond_bug":  # the junk went beyond the cut under FSDP2 (rank 1's rows), within it in one process
        assert one_process["seen"] == [ROWS] and all(got[case]["cut"]["seen"] == [vocab] for got in ranks)


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_the_cut_decides_as_the_whole_vocabulary_and_one_process_do(two_ranks, case):
    check_case(case, two_ranks)


@pytest.mark.parametrize("case", THREE_RANK_CASES)
def test_three_ranks_with_rank_1_straddling_the_cut(three_ranks, case):
    check_case(case, three_ranks)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
