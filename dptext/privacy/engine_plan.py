"""The privacy engine's plan (``PrivacyEngine._plan``, ``replan``, ``detach``): the layers tracked and their rules,
the hooks that record them (the start-up proof's first), the snapshots the per-step checks compare against (global
hooks, planned dtypes and names), and the parameters taken out of autograd — installed together, removed together.
"""

from __future__ import annotations

from typing import Callable

from dptext.errors import UserError
from dptext.privacy.clipping.capture import UseRecorder
from dptext.privacy.clipping.long_sequences import ghost_treated
from dptext.privacy.clipping.owned_params import (carry_trainable_by_name, give_back, keep_in_autograd,
                                                  take_out_of_autograd)
from dptext.privacy.clipping.plan import (_check_optimizer, _module_names, find_tracked_modules, global_hook_keys,
                                          unproven_rules)
from dptext.privacy.proof.cached_gathers import copies_from_the_plan
from dptext.privacy.proof.outside_reads import OutsideReads
from dptext.privacy.sharding.fsdp_controls import UnitAtATime


def install_plan(engine, prove_first_hook: Callable) -> None:
    """Find the trainable layers and their rules, install the hooks, take the parameters out of autograd."""
    engine.names = _module_names(engine.model)
    # FSDP2: a layer's unit gathered where its rule must run it, one at a time, each kept for the probe's first pass
    units = UnitAtATime(engine.model, copies_from_the_plan(engine))
    try:
        engine.tracked = find_tracked_modules(engine.model, engine.clipping_mode, engine._learned_layouts,
                                              units.gathered)
        units.prime()
    finally:
        units.release()
    engine.params = list(dict.fromkeys(module.get_parameter(name) for module, (_, names) in engine.tracked.items()
                                       for name in names))
    if not engine.params:
        raise UserError("The model has no trainable parameters; unfreeze the layers to fine-tune.")
    _check_optimizer(engine.optimizer, engine.params, engine.param_names())
    engine.unproven = unproven_rules(engine.model, engine.tracked)
    engine.global_hooks = global_hook_keys()
    # book-keeping's layers over the memory rule take the ghost treatment (clipping/long_sequences.py)
    engine.ghost_modules = ghost_treated(engine.tracked, engine.max_stored_bytes, engine.sequence_length)
    # ghost mode's second pass (and the hybrid's, for its ghost-treated layers) is autograd over every path: check
    # each step that there is no other one (installed before the recorder, which takes its hooks as the planned ones)
    engine.outside_reads = OutsideReads(engine.model, engine.tracked if engine.clipping_mode == "ghost" else
                                        {module: engine.tracked[module] for module in engine.ghost_modules})
    # the proof's hook first: it runs before the recorder's own hooks see the call (and is part of the plan
    # the recorder snapshots, so a tracked root does not read it as a foreign hook added later)
    def prove_first_then_drop_copies(module, args) -> None:  # the plan's copies serve only a proof made now
        prove_first_hook(module, args)
        engine.plan_copies = None

    prove_first = engine.model.register_forward_pre_hook(prove_first_then_drop_copies, prepend=True)
    engine.recorder = UseRecorder(engine.model, engine.tracked, keep_outputs=engine.clipping_mode == "ghost",
                                  names=engine.names)
    engine.recorder.global_hooks = engine.global_hooks
    engine.recorder.add_handle(prove_first)
    engine.planned_dtypes = {param: param.dtype for param in engine.params}  # what the probe proved
    engine.planned_names = {name for name, param in engine.model.named_parameters(remove_duplicate=False)
                            if param in engine.planned_dtypes}  # a parameter replaced later is trained as before
    if engine.clipping_mode != "ghost":  # autograd must not spend time on weight gradients we compute ourselves
        in_autograd = {module.get_parameter(name) for module in engine.ghost_modules
                       for name in engine.tracked[module][1]}
        take_out_of_autograd([param for param in engine.params if param not in in_autograd])
        keep_in_autograd(in_autograd)


def remove_plan(engine, replanning: bool) -> None:
    """Remove the plan's hooks and give autograd back what it took: for ``replan`` what is still in the model (a
    parameter that replaced a planned one by name is trained again), for ``detach`` all of it; a layer frozen since
    the plan stays frozen. Ghost clipping never took the parameters."""
    engine.plan_copies = None
    engine.recorder.remove()
    engine.outside_reads.remove()
    if engine.clipping_mode == "ghost":
        return
    if replanning:
        carry_trainable_by_name(engine.model, engine.params, engine.planned_names)
    else:
        give_back(engine.params)
