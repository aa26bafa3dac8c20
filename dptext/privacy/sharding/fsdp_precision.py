"""FSDP2's mixed-precision policy set aside while the start-up probe runs, and put back after it.

A run that trains in bf16 under FSDP2 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, the GPU default of
``dptext finetune``) gathers each unit's weights in bf16 for every pass. The probe compares the engine's clipped sums
with brute force, and bf16's rounding (2^-8 relative) would hide a wrong path as easily as show one; the one-process
probe runs the same model in fp64 for that reason, and the sharded probe runs it in the precision the weights are
stored in. So for the probe's duration each unit's policy gathers in that precision (``param_dtype=None``; its
reduction precision is kept: ghost clipping refuses a rounding one, and the probe must see it), and after the probe
the run's policy is restored. The engine's hooks and rules are the same in both: only the dtype the gathered weights
are cast to differs, as between the one-process probe and a bf16-autocast step.

FSDP2 fixes a unit's gathered dtype when it first gathers it: ``FSDPParam`` allocates its all-gather output in the
policy's ``param_dtype`` and wraps it, once, in the unsharded ``nn.Parameter`` the layers see. Switching the policy
therefore also drops those two (the next gather allocates them anew in the new dtype). That is FSDP2's internal state
(torch 2.13, the version dptext pins); ``tests/test_fsdp_precision.py`` checks that a run proven this way trains
bit for bit as one sharded in bf16 from the start, so a torch that changes it fails there, not silently.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from dptext.privacy.sharding.fsdp_controls import fsdp_modules

HALF = (torch.float16, torch.bfloat16)


def half_policy(model: nn.Module) -> torch.dtype | None:
    """bf16 or fp16 if some FSDP2 unit of ``model`` gathers its weights in it by its policy, else None."""
    return next((state._mp_policy.param_dtype for state in _states(model)
                 if state._mp_policy.param_dtype in HALF), None)


def half_stored(model: nn.Module) -> torch.dtype | None:
    """bf16 or fp16 if some of ``model``'s weights are stored in it (no policy gathers them in more), else None."""
    return next((param.dtype for param in model.parameters() if param.dtype in HALF), None)


@contextmanager
def gathered_as_stored(model: nn.Module):
    """Inside the block, every FSDP2 unit of ``model`` gathers its weights in the precision they are stored in,
    whatever its policy; the policies are restored after (both moments with every unit resharded)."""
    switched = [(state, state._mp_policy) for state in _states(model) if state._mp_policy.param_dtype in HALF]
    if not switched:
        yield
        return
    _reshard(model)
    for state, policy in switched:
        _set_policy(state, replace(policy, param_dtype=None, output_dtype=None))
    try:
        yield
    finally:
        _reshard(model)
        for state, policy in switched:
            _set_policy(state, policy)


def _states(model: nn.Module) -> list:
    return list({id(state): state for state in (m._get_fsdp_state() for m in fsdp_modules(model))}.values())


def _reshard(model: nn.Module) -> None:
    for unit in fsdp_modules(model):
        unit.reshard()


def _set_policy(state, policy) -> None:
    """``policy`` on one FSDP2 state and its param groups, read again by each parameter (as FSDP2's lazy
    initialisation does); each parameter's gathered buffer and unsharded parameter are dropped, since they were
    allocated in the old dtype (the next all-gather makes new ones)."""
    state._mp_policy = policy
    for group in state._fsdp_param_groups:
        group.mp_policy = policy
        group._init_mp_dtypes()
        for param in group.fsdp_params:
            param.all_gather_outputs = []
            if hasattr(param, "_unsharded_param"):
                del param._unsharded_param
