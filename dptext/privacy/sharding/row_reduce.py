"""Book-keeping and per_sample under FSDP2: each micro-batch's clipped sums are reduce-scattered a chunk of layers at
a time as they are formed, so a rank never holds a full-size clipped sum (docs/sharding.md, "Memory").

The clipping factors need every layer's per-example norm, so no sum can be formed before the whole backward pass
has run; from then on the sums are formed chunk by chunk, each chunk reduce-scattered at once (FSDP2's ``Shard(0)``
layout: rank r receives the sum over the ranks of its rows) and added to this rank's rows, and only then is the next
chunk formed. A chunk holds whole layers: every parameter of a tracked module, and every module that shares one of
them (a tied embedding and head are one chunk), so each recorded use is summed exactly once, in its chunk. Chunks
are a function of the plan only, the same on every rank, and every rank reduces every chunk in every micro-batch —
zeros where it has no sum (an empty pass, a refused micro-batch) — so the collectives always match.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

CHUNK_COORDINATES = 1 << 24  # a chunk's full-size sums (64 MiB in fp32) are alive at once, plus its send buffer


def sum_chunks(tracked: dict, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters in groups of whole layers (modules sharing a parameter kept together), in plan order,
    each group filled up to ``CHUNK_COORDINATES`` (a larger layer is a group of its own)."""
    owner: dict[nn.Parameter, int] = {}  # union-find over modules: parameter -> first module index
    parent = list(range(len(tracked)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for index, (module, (_, names)) in enumerate(tracked.items()):
        for name in names:
            param = module.get_parameter(name)
            if param in owner:
                parent[root(index)] = root(owner[param])
            else:
                owner[param] = index
    components: dict[int, list[nn.Parameter]] = {}
    for param in params:  # plan order: the first parameter of a component places it
        components.setdefault(root(owner[param]), []).append(param)
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for component in components.values():
        numel = sum(param.numel() for param in component)
        if chunks and size + numel <= CHUNK_COORDINATES:
            chunks[-1].extend(component)
            size += numel
        else:
            chunks.append(list(component))
            size = numel
    return chunks


def local_rows(param: Tensor, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, row count) of ``param``'s dim-0 shard on ``rank``: FSDP2 gives each rank ⌈d/N⌉ rows, the last
    ones fewer (possibly none)."""
    rows = param.shape[0] if param.ndim else 1
    per_rank = -(-rows // world_size)
    first = min(rank * per_rank, rows)
    return first, min(per_rank, rows - first)


def reduce_rows(params: list[nn.Parameter], totals: dict[nn.Parameter, Tensor], rank: int,
                world_size: int, cut_rows: dict[Tensor, int] | None = None) -> dict[nn.Parameter, Tensor]:
    """This rank's rows of Σ_ranks ``totals[p]`` for each p in ``params`` (FSDP2 shards; a missing total counts as
    zeros), in fp32, by one ``reduce_scatter`` over a send buffer holding rank r's rows of every parameter side by
    side. The totals are consumed (popped) as they are copied in. ``cut_rows``: the probe's vocabulary cut
    (``proof.vocabulary``), where a parameter's total may have only its first rows (the rest count as zeros)."""
    layout, width = [], 0
    for param in params:
        rows = param.shape[0] if param.ndim else 1
        per_rank = -(-rows // world_size)
        layout.append((param, rows, per_rank, param.numel() // max(rows, 1)))
        width += per_rank * layout[-1][3]
    device = params[0].to_local().device
    send = torch.zeros(world_size, width, dtype=torch.float32, device=device)
    offset = 0
    for param, rows, per_rank, row_size in layout:
        total = totals.pop(param, None)
        if total is not None:  # rows beyond the parameter's end stay zero (FSDP2 pads the last shard)
            slots = send[:, offset:offset + per_rank * row_size].unflatten(1, (per_rank, row_size))
            held = (cut_rows or {}).get(param, rows)
            total = total.reshape(held if total.numel() == held * row_size else rows, row_size)
            for other in range(world_size):
                first, count = local_rows(param, other, world_size)
                count = max(0, min(count, len(total) - first))  # (a cut total: its rows only)
                slots[other, :count].copy_(total[first:first + count])
        del total
        offset += per_rank * row_size
    mine = send.new_empty(width)
    reduce_scatter(mine, send.view(-1))
    del send
    out, offset = {}, 0
    for param, rows, per_rank, row_size in layout:
        _, count = local_rows(param, rank, world_size)
        out[param] = mine[offset:offset + count * row_size].view(param.to_local().shape)
        offset += per_rank * row_size
    return out


def reduce_scatter(mine: Tensor, send: Tensor) -> None:
    """``mine`` = this rank's block of Σ_ranks ``send`` (the ranks' blocks side by side), summed."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    scatter(mine, send, op=dist.ReduceOp.SUM)


def reduce_to_own_rows(total: Tensor, param: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's rows (``param``'s FSDP2 Shard(0) layout) of Σ_ranks ``total``, a tensor of ``param``'s whole
    shape or of its first rows only (the probe's vocabulary cut: the others count as zeros), in ``total``'s dtype,
    by one reduce-scatter: each rank receives only its rows, where an all-reduce sent every rank the whole sum."""
    if total.ndim == 0 or param.ndim == 0:
        total = total.clone()
        dist.all_reduce(total)
        return total
    flat = total.reshape(len(total), -1)
    spans = [local_rows(param, other, world_size) for other in range(world_size)]
    counts = [max(0, min(count, len(flat) - first)) for first, count in spans]
    width = max(counts) * flat.shape[1]
    if len(set(counts)) == 1 and sum(counts) == len(flat):  # whole rows dealt out evenly: the sum is its own buffer
        send = flat.contiguous().view(-1)
    else:
        send = flat.new_zeros(world_size, width)
        for other, ((first, _), count) in enumerate(zip(spans, counts)):
            send[other, :count * flat.shape[1]] = flat[first:first + count].reshape(-1)
        send = send.view(-1)
    mine = flat.new_empty(width)
    reduce_scatter(mine, send)
    return mine[:counts[rank] * flat.shape[1]].view(counts[rank], *total.shape[1:])


def reduce_in_chunks(optimizer, chunks: list[list[nn.Parameter]],
                     sums_of: Callable[[list[nn.Parameter]], dict[nn.Parameter, Tensor]] | None, units: int,
                     cut_rows: dict[Tensor, int] | None = None) -> None:
    """One micro-batch: for each chunk, its clipped sums (``sums_of(chunk)``; None: this rank adds nothing) reduced
    over the ranks and added to this rank's rows (``optimizer.add_reduced``), one chunk alive at a time."""
    for chunk in chunks:
        totals = sums_of(chunk) if sums_of is not None else {}
        optimizer.add_reduced(reduce_rows(chunk, totals, optimizer.rank, optimizer.world_size, cut_rows), 0)
        del totals
    optimizer.add_reduced({}, units)
