"""The probe's second shape on the first rows of the vocabulary under FSDP2 (``proof.vocabulary.sharded_cut``):
the unsharded matrices FSDP2 registers at each pass are cut, never the shards (issue 42). 2 gloo processes.

Checked: on a tied Llama with a 4,096-token vocabulary, the sharded probe runs its second shape with the matrices
the layers see cut to their first rows (32 here: the tests keep twice the width) while the shards keep every row;
the engine's clipped sums of the cut matrix reach the shards' layout with zeros beyond (each rank compares its rows:
rank 1 holds none of the cut); the verdicts equal the one-process probe's; the shards and FSDP2's registered
matrices are whole after it, and the DP step after the probe moves the weights as one process does. Ghost clipping
keeps the whole vocabulary (FSDP2 reduces its sums).
Unit checks: a cut total's rows reach the reduce-scatter's send buffer with zeros beyond; the reference's sums reach
each rank as its rows (``row_reduce.reduce_to_own_rows``); ``sum_error`` counts the engine's rows beyond the cut
against the reference's zeros.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_fsdp_redteam import outcome
from two_ranks import run_two_ranks

TIMEOUT = 300
VOCAB, WIDTH = 4096, 16


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).double()


def run(ctx=None, mode="bookkeeping") -> dict:
    """The probe (its statuses, the rows of the matrix the head saw at each call, the cut rows the sums were
    compared under) and one DP step's change of the whole weights."""
    from dptext.privacy import PrivacyEngine, causal_lm_loss
    from dptext.privacy.proof import probe_checks
    from dptext.privacy.proof.synthetic import output_functional_loss
    from dptext.privacy.proof.verify import probe

    model = build()
    if ctx is not None:
        from dptext.finetune.sharding import shard_model

        shard_model(model)
    head_rows, cut_compared = [], []
    real_error = probe_checks.sum_error

    def spied(view, got, expected, param):
        if view is not None and param in view.cut_rows:
            cut_compared.append(view.cut_rows[param])
        return real_error(view, got, expected, param)

    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=0.0,
                           max_grad_norm=1e-3, expected_batch_size=4, dataset_size=100, clipping_mode=mode,
                           distributed=ctx, verify=False)
    def loss(model, batch):  # the logits' width: the rows of the tied matrix the head computed with
        out = model(**batch)
        head_rows.append(out.logits.shape[-1])
        return output_functional_loss(lambda **_: out, batch)

    probe_checks.sum_error = spied
    try:
        verdict, report = outcome(lambda: probe(engine, loss_fn=loss))
    finally:
        probe_checks.sum_error = real_error
    table = {row["name"]: row["status"] for row in report.table()} if verdict == "ok" else report
    whole = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    shapes_after = [tuple(_full(p).shape) for p in model.parameters()]
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    if ctx is not None:
        ids = ids[ctx.rank * 2:(ctx.rank + 1) * 2]
    engine.step(causal_lm_loss(model(input_ids=ids).logits, ids))
    moved = {name: (_full(p).detach() - whole[name]).norm().item() for name, p in model.named_parameters()}
    engine.detach()
    return {"verdict": verdict, "table": table, "head_rows": sorted(set(head_rows)), "cut_compared": cut_compared,
            "shapes_after": shapes_after, "moved": moved}


def _full(param):
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def worker(out: Path) -> None:
    from dptext.finetune.distributed import current, release

    from dptext.privacy.proof import vocabulary

    vocabulary.KEPT_ROWS = 16  # as tests/conftest.py sets it for the one-process probe
    ctx = current("cpu")
    ctx.sharded = True
    torch.save({mode: run(ctx, mode) for mode in ("bookkeeping", "ghost")}, out / f"rank{ctx.rank}.pt")
    release()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(__file__, tmp_path_factory.mktemp("ranks"), TIMEOUT)


def test_the_sharded_probe_proves_its_second_shape_on_the_cut_vocabulary(two_ranks):
    rows = 2 * WIDTH  # (KEPT_ROWS is 16 in the tests: the rows kept are twice the width)
    one_process = run()
    assert one_process["head_rows"] == [rows, VOCAB]  # (the one-process probe cuts too)
    for got in two_ranks:
        result = got["bookkeeping"]
        assert result["verdict"] == "ok" and result["table"] == one_process["table"]
        assert result["head_rows"] == [rows, VOCAB]  # the layers saw the cut at the second shape
        assert result["cut_compared"] and set(result["cut_compared"]) == {rows}
        assert result["shapes_after"] == [tuple(p.shape) for p in build().parameters()]
        for name, change in one_process["moved"].items():  # the step after the probe as in one process
            assert result["moved"][name] == pytest.approx(change, rel=1e-6, abs=1e-12), name


def test_ghost_keeps_the_whole_vocabulary_under_fsdp2(two_ranks):
    for got in two_ranks:
        assert got["ghost"]["verdict"] == "ok"
        assert got["ghost"]["head_rows"] == [VOCAB] and not got["ghost"]["cut_compared"]


def test_a_cut_total_fills_its_rows_of_the_send_buffer_and_zeros_beyond(monkeypatch):
    from dptext.privacy.sharding import row_reduce

    param = torch.zeros(10, 3)
    param.to_local = lambda: torch.zeros(5, 3)  # (a stand-in for rank 0's shard of a 10-row parameter)
    sent = {}

    def scatter(mine, send, op):
        sent["send"] = send.clone()
        mine.copy_(send.view(2, -1)[0])

    monkeypatch.setattr(row_reduce.dist, "reduce_scatter_single", scatter, raising=False)
    total = torch.arange(1.0, 22.0).view(7, 3)  # the first 7 rows of the sum: rank 0's 5, two of rank 1's
    out = row_reduce.reduce_rows([param], {param: total}, 0, 2, cut_rows={param: 7})
    send = sent["send"].view(2, 5, 3)
    assert torch.equal(send[0], total[:5]) and torch.equal(send[1, :2], total[5:])
    assert not send[1, 2:].any()
    assert torch.equal(out[param], total[:5])
    with pytest.raises(RuntimeError):  # without the cut a short total is still an error
        row_reduce.reduce_rows([param], {param: total}, 0, 2)


@pytest.mark.parametrize("rows", [10, 7, 3])
def test_the_reference_sum_reaches_each_rank_as_its_rows(monkeypatch, rows):
    from dptext.privacy.sharding import row_reduce

    param = torch.zeros(10, 3)  # two ranks, five rows each; the sum has all ten rows, or the cut's first ones
    total = torch.arange(1.0, 3.0 * rows + 1).view(rows, 3)
    sent = {}

    def scatter(mine, send, op):
        sent["send"] = send.clone()
        mine.copy_(send.view(2, -1)[1])  # (one rank: the others' rows count as zeros)

    monkeypatch.setattr(row_reduce.dist, "reduce_scatter_single", scatter, raising=False)
    mine = row_reduce.reduce_to_own_rows(total, param, 1, 2)
    assert torch.equal(mine, total[5:])  # rank 1's rows, as many as the sum has
    if rows == 10:  # whole rows dealt out evenly: the sum itself is sent, not a copy
        assert torch.equal(sent["send"], total.view(-1))
    else:
        send = sent["send"].view(2, -1)
        assert torch.equal(send[0, :3 * min(rows, 5)], total[:5].reshape(-1)) and not send[0, 3 * min(rows, 5):].any()


def test_sum_error_counts_the_engines_rows_beyond_the_cut():
    from dptext.privacy.proof.probe_checks import sum_error
    from dptext.privacy.proof.sharded_probe import ShardedView

    param = torch.zeros(10, 3)  # rank 1 of 2 holds rows 5-9; the reference has the cut's 7 rows
    view = ShardedView({}, rank=1, world_size=2)
    view.cut_rows = {param: 7}
    view.total = lambda value: value  # (one rank's share is the whole here)
    expected = torch.randn(7, 3, dtype=torch.float64)[5:]  # (rank 1's rows of the reference: two of the cut's)
    got = torch.zeros(5, 3, dtype=torch.float64)
    got[:2] = expected * 2  # the engine's rows are world_size x the sum
    assert sum_error(view, got, expected, param) == pytest.approx(0.0, abs=1e-12)
    got[4, 1] = 2.0  # a row beyond the cut: the reference's is zero
    assert sum_error(view, got, expected, param) == pytest.approx(1.0)
    view.cut_rows = {}
    assert sum_error(view, got, expected, param) is None  # not cut: the shapes differ


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
