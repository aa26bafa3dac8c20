"""DP training on ``torch.distributed``: one process per device, launched with ``torchrun``.

Launch (CPU: gloo; GPU: NCCL, one process per GPU)::

    torchrun --standalone --nproc_per_node 2 -m dptext finetune RECIPE.yaml [key=value ...] [--out DIR]

Without torchrun (no ``WORLD_SIZE`` > 1 in the environment) everything runs in one process exactly as before.

How the privacy of the distributed step is kept equal to the single-process one (SPEC §1, §4):

* **Shards fixed by index.** Example i lives on rank ``i mod N`` (independent of the data) and is
  Poisson-sampled there with the global rate q by that rank's own generator. The union of the ranks' samples
  is a Poisson sample of the whole set with rate q, so the ledger accounts q = B/n with B the expected global
  batch. Adding or removing one example changes only its own rank's batch. Each rank's sampler draws from its
  own child of the random root (``dptext.privacy.randomness``, spawn key (sampler, rank)), never an offset seed
  and never the noise's stream.
* **Clipping is local.** Each rank clips its own examples with the engine's clipping mode (or, for eDP-SGD,
  its own micro-batches); the clipped sums are all-reduced (summed) in one flat buffer.
* **Noise is added once, on rank 0**, before the all-reduce: N(0, σ²C²) per coordinate, exactly the σ the
  accountant assumed, from rank 0's noise generator (the same one a single-process run with the same root
  uses). We do not split it into N shares N(0, σ²C²/N): a split needs every rank's noise to be honest and
  independent (a rank with a broken or shared seed, or a rank that sees its own pre-aggregation share, would
  leave the sum under-noised), while one draw on one rank makes the guarantee depend on one generator and is
  testable against the single-process run. The cost is one rank drawing the noise of the whole model, which
  a single-process run pays anyway.
* **Only rank 0 writes** the run directory (checkpoints, metrics, ledger, model, result). Other ranks read it
  (resume) and drop their writes; checkpoints hold every rank's sampler and RNG state, gathered to rank 0.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from dptext.errors import UserError

TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class DistributedContext:
    """Rank and world size of this process; a world of 1 is the ordinary single-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    started_here: bool = False  # this module initialised the process group (and so destroys it)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run directory; the others never write a file."""
        return self.rank == 0

    def shard(self, dataset_size: int) -> list[int]:
        """The example indices this rank owns: i with i mod N = rank (fixed by index, not by data)."""
        return list(range(self.rank, dataset_size, self.world_size))

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, tensors: dict[Any, Any]) -> dict[Any, Any]:
        """Sum each tensor over the ranks (one flat buffer, one all-reduce); same keys, new tensors."""
        if not self.active or not tensors:
            return tensors
        import torch
        import torch.distributed as dist

        keys = list(tensors)
        flat = torch.cat([tensors[k].reshape(-1).float() for k in keys])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        out, start = {}, 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[start:start + n].view_as(tensors[k]).to(tensors[k].dtype)
            start += n
        return out

    def gather(self, value: Any) -> Any:
        """Every rank's ``value`` as a list indexed by rank (all ranks call it); the value itself when alone."""
        if not self.active:
            return value
        import torch.distributed as dist

        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def mine(self, gathered: Any) -> Any:
        """This rank's entry of what ``gather`` returned (and a checkpoint saved)."""
        if not self.active:
            if isinstance(gathered, list):
                raise UserError(f"This checkpoint was written by {len(gathered)} processes; resume it with "
                                f"torchrun --nproc_per_node {len(gathered)} -m dptext finetune --resume RUN_DIR.")
            return gathered
        if not isinstance(gathered, list) or len(gathered) != self.world_size:
            saved = len(gathered) if isinstance(gathered, list) else 1
            raise UserError(f"This checkpoint was written by {saved} process(es) but {self.world_size} are "
                            f"resuming it; resume with torchrun --nproc_per_node {saved}.")
        return gathered[self.rank]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_parameters(self, model: Any) -> None:
        """Start every rank from rank 0's weights (they are seeded alike; this makes it certain)."""
        if not self.active:
            return
        import torch.distributed as dist

        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)

    def sum_floats(self, *values: float) -> tuple[float, ...]:
        """Each number summed over the ranks (for logging)."""
        import torch

        device = torch.device("cuda", self.local_rank) if _backend() == "nccl" else torch.device("cpu")
        reduced = self.all_reduce_sum({"v": torch.tensor([float(v) for v in values], dtype=torch.float64,
                                                         device=device)})["v"]
        return tuple(reduced.tolist())

    def average_gradients(self, params: list, local_count: int) -> int:
        """Non-private baseline: replace each grad by Σ_ranks grad / (global example count); returns that count."""
        import torch

        grads = {i: (p.grad if p.grad is not None else torch.zeros_like(p)) for i, p in enumerate(params)}
        grads["count"] = torch.tensor([float(local_count)], device=params[0].device)
        reduced = self.all_reduce_sum(grads)
        count = int(round(reduced.pop("count").item()))
        for i, param in enumerate(params):
            param.grad = reduced[i] / count if count else None
        return count

    def close(self) -> None:
        if self.started_here:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.started_here = False


_CURRENT: DistributedContext | None = None


def _backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "gloo"


def silent_output():
    """The output of ranks other than 0: no messages, no progress lines (rank 0 reports the run)."""
    from contextlib import contextmanager

    from dptext.output import Output, Progress

    class SilentOutput(Output):
        @contextmanager
        def progress(self, total, description):
            handle = Progress(self, total, description)
            handle._maybe_print_plain = lambda force=False: None
            yield handle

    return SilentOutput(quiet=True)


def current(device_name: str = "auto") -> DistributedContext:
    """The context of this process, initialising the process group from torchrun's environment once.

    gloo when the training device is the CPU, NCCL on GPUs (then each process takes ``cuda:LOCAL_RANK``).
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        _CURRENT = DistributedContext()
        return _CURRENT
    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    started = False
    if not dist.is_initialized():
        use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=TIMEOUT)
        started = True
    _CURRENT = DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, started_here=started)
    return _CURRENT


def release() -> None:
    """Destroy the process group this module started (end of a run)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


class FollowerRun:
    """What a rank other than 0 sees of the run directory: reads pass through, every write is dropped."""

    def __init__(self, path: Any):
        from dptext.runs import RunDir

        self._run = RunDir(path)
        self.path = self._run.path

    def __getattr__(self, name: str) -> Any:  # reads: recipe, load_checkpoint, load_result, read_metrics ...
        if name.startswith(("save_", "log_", "truncate_")):
            return lambda *args, **kwargs: None
        return getattr(self._run, name)
