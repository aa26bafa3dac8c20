"""The process group of a ``torchrun`` training run: set-up, who writes, and the follower run directory.

Launch (CPU: gloo; GPU: NCCL, one process per GPU)::

    torchrun --standalone --nproc_per_node 2 -m dptext finetune RECIPE.yaml [key=value ...] [--out DIR]

Without torchrun (no ``WORLD_SIZE`` > 1 in the environment) ``current()`` is a world of one and everything runs
in one process. How the privacy of the distributed step equals the single-process one (sharding, the all-reduce
of clipped sums, noise drawn once on rank 0) is the mechanism's business: ``dptext.privacy.sharding.distributed``. Here:
the process group (initialised once from torchrun's environment, destroyed at the end), the run-level
collectives (checkpoint state gathered to rank 0, rank 0's weights broadcast, logged numbers and the
non-private gradient averaged), rank 0 as the only writer and what the other ranks see of the run directory.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dptext.errors import UserError
from dptext.output import Output, Progress
from dptext.privacy.sharding.distributed import DistributedContext
from dptext.runs import RunDir

TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class ProcessGroup(DistributedContext):
    """The mechanism's context plus what the run does with the processes: checkpoints, weights, logging."""

    started_here: bool = False  # this module initialised the process group (and so destroys it)

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run directory; the others never write a file."""
        return self.rank == 0

    def gather(self, value: Any) -> Any:
        """Every rank's ``value`` as a list indexed by rank (all ranks call it); the value itself when alone."""
        if not self.active:
            return value
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

    def broadcast_parameters(self, model: Any) -> None:
        """Start every rank from rank 0's weights (they are seeded alike; this makes it certain)."""
        if not self.active:
            return
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)

    def sum_floats(self, *values: float) -> tuple[float, ...]:
        """Each number summed over the ranks (for logging)."""
        device = torch.device("cuda", self.local_rank) if _backend() == "nccl" else torch.device("cpu")
        reduced = self.all_reduce_sum({"v": torch.tensor([float(v) for v in values], dtype=torch.float64,
                                                         device=device)})["v"]
        return tuple(reduced.tolist())

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over the ranks (all ranks call it)."""
        if not self.active:
            return value
        device = torch.device("cuda", self.local_rank) if _backend() == "nccl" else torch.device("cpu")
        box = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    def average_gradients(self, params: list, local_count: int) -> int:
        """Non-private baseline: replace each grad by Σ_ranks grad / (global example count); returns that count."""
        if self.sharded:  # FSDP2 already reduce-scattered Σ_ranks grad / N into each rank's shard
            count = int(round(self.sum_floats(local_count)[0]))
            for param in params:
                param.grad = param.grad * (self.world_size / count) if count and param.grad is not None else None
            return count
        grads = {i: (p.grad if p.grad is not None else torch.zeros_like(p)) for i, p in enumerate(params)}
        grads["count"] = torch.tensor([float(local_count)], device=params[0].device)
        reduced = self.all_reduce_sum(grads)
        count = int(round(reduced.pop("count").item()))
        for i, param in enumerate(params):
            param.grad = reduced[i] / count if count else None
        return count

    def close(self) -> None:
        if self.started_here:
            _tear_down()
            self.started_here = False


def _tear_down() -> None:
    if dist.is_initialized():
        # Every rank waits for the others before tearing down: a rank that destroyed its group while a peer still
        # had gloo traffic in flight (rank 0 gathering the full weights) aborted at exit.
        dist.barrier()
        dist.destroy_process_group()


_CURRENT: ProcessGroup | None = None


def _backend() -> str:
    return dist.get_backend() if dist.is_initialized() else "gloo"


class SilentOutput(Output):
    @contextmanager
    def progress(self, total, description, start=0):
        handle = Progress(self, total, description, start)
        handle._maybe_print_plain = lambda force=False: None
        yield handle


def silent_output():
    """The output of ranks other than 0: no messages, no progress lines (rank 0 reports the run)."""
    return SilentOutput(quiet=True)


def current(device_name: str = "auto") -> ProcessGroup:
    """The context of this process, initialising the process group from torchrun's environment once.

    gloo when the training device is the CPU, NCCL on GPUs (then each process takes ``cuda:LOCAL_RANK``).
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        _CURRENT = ProcessGroup()
        return _CURRENT
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    started = False
    if not dist.is_initialized():
        use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=TIMEOUT)
        started = True
    _CURRENT = ProcessGroup(rank=rank, world_size=world_size, local_rank=local_rank, started_here=started)
    return _CURRENT


def release() -> None:
    """Destroy the process group this module started (end of a run)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


def end_process_group() -> None:
    """Tear down torch.distributed's default group whoever started it (accelerate, under a ``DPTrainer`` script).

    A script that leaves the group to interpreter shutdown lets each rank's gloo threads die while a peer may still
    be closing its sockets, an occasional SIGABRT after a finished run; call this as the script's last step. Even
    then gloo's threads can abort a rank during the interpreter's teardown; ``dptext``'s own ranks therefore end
    with ``os._exit`` once their output is flushed (dptext.cli.app), which a script may do too."""
    global _CURRENT
    _tear_down()
    _CURRENT = None


class FollowerRun:
    """What a rank other than 0 sees of the run directory: reads pass through, every write is dropped."""

    def __init__(self, path: Any):
        self._run = RunDir(path)
        self.path = self._run.path

    def __getattr__(self, name: str) -> Any:  # reads: recipe, load_checkpoint, load_result, read_metrics ...
        if name.startswith(("save_", "log_", "truncate_")):
            return lambda *args, **kwargs: None
        return getattr(self._run, name)
