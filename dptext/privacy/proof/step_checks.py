"""The engine's fail-closed checks at every step (docs/privacy_engine.md "Fail closed", points 2 and 3).

Each stops the step before anything from the batch joins the logical batch, with one sentence naming the layer or
parameter: uses that cannot be trusted (rows that are not examples, outputs changed in place, foreign hooks added
after the plan, rules still unproven by the probe), a trainable set that changed after the plan, and the per-step
invariant on the clipped sums. Messages never carry a value from the batch: these checks run on private data.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.clipping import sums as clipping
from dptext.privacy.clipping.call_checks import refuse_mode_around
from dptext.privacy.clipping.owned_params import frozen_since_plan
from dptext.privacy.clipping.plan import global_hook_keys


def checked_uses(engine, per_example_loss: Tensor) -> list | None:
    """The uses recorded for ``per_example_loss``'s forward pass, each one checked (see the module docstring).

    One process raises a failed check at once. With several, a failed check refuses the logical batch and returns
    None: the caller goes on through the micro-batch's collectives (ghost's second pass under FSDP2) adding nothing,
    and every rank raises it at the step. A check that fails on one rank only (a hook added on rank 0 alone, rows
    that stop being examples for one rank's data) would otherwise leave the other ranks waiting for ever."""
    uses = engine.recorder.take_uses()
    error = _untrusted(engine, uses, per_example_loss)
    if error is None:
        return uses
    if deferred_to_the_step(engine, error):
        return None
    raise error


def deferred_to_the_step(engine, error: UserError) -> bool:
    """Several processes, in training: ``error`` refuses the logical batch here and is raised on every rank at the
    step (``DPOptimizer.refuse``); True. One process, or the probe (its synthetic batches are the same on every
    rank): False, and the caller raises it at once."""
    if engine.dp_optimizer.any_rank is None or engine.recorder.probing:
        return False
    engine.dp_optimizer.refuse(error)
    return True


def _untrusted(engine, uses: list, per_example_loss: Tensor) -> UserError | None:
    recorder = engine.recorder
    if not recorder.probing and global_hook_keys() != engine.global_hooks:
        return UserError("A global module hook (torch.nn.modules.module.register_module_forward_hook or a sibling) "
                         "was added or removed after the privacy engine planned its clipping; it runs on every "
                         "layer's call, so call engine.replan() (it re-runs the probe) after changing it.")
    if not uses:
        return UserError("No trainable layer received a gradient; was the model called with the engine's hooks "
                         "(not under torch.no_grad) before this step?")
    for use in uses:
        name = engine.names.get(use.module, type(use.module).__name__)
        if not recorder.probing and recorder.hooks_changed(use.module):  # (before the use's own problem, which
            return UserError(f"Forward hooks of layer '{name}' changed after the privacy engine planned its "  # says
                             "clipping; call engine.replan() (it re-runs the probe) after adding hooks.")  # it too)
        if use.problem:
            return UserError(f"Layer '{name}' ({type(use.module).__name__}) cannot be clipped exactly: "
                             f"{use.problem}; freeze it, train it through LoRA, or change the model.")
        if use.module in engine.unproven and use.module not in recorder.verified and not recorder.probing:
            return UserError(f"Layer '{name}' ({type(use.module).__name__}) needs the start-up probe because "
                             f"{engine.unproven[use.module]}; run engine.verify() (privacy.verify) or freeze it.")
    wrong = [use for use in uses if use.batch_size != len(per_example_loss)]
    if wrong:
        layer = recorder.names.get(wrong[0].module, type(wrong[0].module).__name__)
        return UserError(f"Layer '{layer}' ({type(wrong[0].module).__name__}) saw {wrong[0].batch_size} rows but "
                         f"the loss has {len(per_example_loss)} examples, so its rows are not examples (tokens "
                         "gathered or flattened across the batch, or a second forward pass); freeze it, or run "
                         "one forward pass per accumulate/step call.")
    return None


HOOKS_BEFORE_PROOF = ("{} added or removed after the privacy engine planned its clipping, so verify() would prove "
                      "hooks that every step then refuses; call engine.replan() instead (it plans again and runs the "
                      "probe), or build the engine after registering them.")


def check_hooks_as_planned(engine) -> None:
    """Before the probe (``verify``): the model's hooks are still the plan's. The probe runs with the hooks present
    then, and every step compares them with the plan's, so a hook registered between the engine's construction and
    ``verify()`` was proven and then refused at every step (a red team's find); one sentence here instead, which
    proves nothing the steps would not run. With several processes every rank decides alike (the probe is
    collective: a rank refusing alone would leave the others waiting in it)."""
    changed = [engine.names.get(module, type(module).__name__) for module in engine.tracked
               if engine.recorder.hooks_changed(module)]
    what = f"Forward hooks of layer '{changed[0]}' were" if changed else (
        "A global module hook (torch.nn.modules.module.register_module_forward_hook or a sibling) was"
        if global_hook_keys() != engine.global_hooks else None)
    any_rank = engine.dp_optimizer.any_rank
    if any_rank is not None and any_rank(what is not None, engine.dp_optimizer.device()):
        what = what or "Forward hooks on another rank were"
    if what is not None:
        raise UserError(HOOKS_BEFORE_PROOF.format(what))


def check_invariant(engine, sums, norms: Tensor, units: int) -> None:
    """The per-step invariant (``clipping.check_clipped_sums``); a violation drops the logical batch. With several
    processes it is raised at the step, on every rank together (``DPOptimizer.refuse``): the data that broke it is
    on one rank only, and the others would otherwise wait for that rank in the next collective."""
    problem = clipping.check_clipped_sums(sums, norms, units, engine.max_grad_norm, engine.clipping_layout,
                                          len(engine.params))
    if problem is not None:
        param, why = problem
        error = invariant_failed(engine.param_names().get(param, "?") if param is not None else None, why)
        if deferred_to_the_step(engine, error):
            return
        engine.dp_optimizer.zero_grad()
        raise error


def invariant_failed(name: str | None, why: str) -> UserError:
    where = f"at parameter '{name}'" if name is not None else "for the model as a whole"
    return UserError(f"The per-step privacy check failed {where} ({why}); nothing from this batch "
                     "was applied — lower the learning rate if training diverged, else report this engine bug and "
                     "use clipping_mode='per_sample' meanwhile.")


UNITS_WITHOUT_USER_SAMPLER = (
    "accumulate(units=...) clips each unit's summed gradient, but this engine's ε is about single examples (its "
    "batches come from engine.sampler(), not engine.user_sampler()), and one example could move its unit's clipped "
    "sum by 2C; draw the batches with engine.user_sampler(users, max_examples_per_user, steps), or pass units=None.")


def check_loss(engine, per_example_loss: Tensor, units: Tensor | None) -> None:
    """What ``accumulate`` is given: one loss per example that depends on a trained layer (an empty micro-batch
    need not), and no units across processes; and that it runs inside no user mode (``refuse_mode_around``)."""
    refuse_mode_around("accumulate")  # before anything is recorded or differentiated
    if type(per_example_loss) is not Tensor:  # its __torch_function__ would run in the engine's own arithmetic
        raise UserError(f"The per-example loss is a tensor subclass ({type(per_example_loss).__name__}); pass a "
                        "plain tensor (e.g. loss.as_subclass(torch.Tensor) after checking what the subclass does).")
    if per_example_loss.ndim != 1:
        raise UserError("Pass one loss per example (a 1-D tensor, e.g. from dptext.privacy.per_example_loss), "
                        "not a batch-averaged scalar.")
    if units is not None and engine.max_examples_per_user is None:
        raise UserError(UNITS_WITHOUT_USER_SAMPLER)
    if units is not None and engine.distributed is not None:
        raise UserError("Per-unit clipping is not supported across processes yet (a unit split over ranks "
                        "would be clipped once per rank); train user-level DP in one process.")
    if per_example_loss.numel() and not per_example_loss.requires_grad:
        raise UserError("The loss does not depend on any trainable layer; check that the model forward "
                        "ran with gradients enabled after the engine was created.")


def check_no_foreign_backward(engine) -> None:
    """Before the engine's own backward pass: no recorded layer use may hold a gradient yet. One that does was
    reached by a backward pass the engine did not issue (the user's loss.backward(), an input-saliency or
    adversarial inner pass), and its rows would be merged with this batch's examples by position."""
    foreign = [use for use in engine.recorder.uses if use.grad_output is not None]
    if foreign:
        engine.zero_grad()
        raise UserError(f"A backward pass the privacy engine did not issue reached {len(foreign)} recorded layer "
                        "uses since the last accumulate; pass the per-example loss to engine.accumulate() (or "
                        "engine.step()) and run other backward passes with the engine detached or under "
                        "engine.recorder.paused(); the logical batch so far was dropped.")


FOREIGN_GRADIENT = ("A gradient not issued by the engine reached .grad in a micro-batch (a plain loss.backward(), or "
                    ".grad clipped or edited between its chunks); only engine.accumulate may compute gradients of "
                    "private data, so the micro-batch so far was dropped.")


def grads_as_left(params, left: list | None) -> bool:
    """Whether every parameter's .grad is as the engine left it (``left``: ``grads_now`` after its last backward;
    None: none yet, so every .grad must be empty). A backward the engine did not issue adds to a .grad in place
    (its version counter moves) or replaces it, and fills an empty one; a write through ``.grad.data`` (a tensor
    sharing the memory with a version counter of its own) keeps the counter but changes the values' norms."""
    if left is None:
        return all(param.grad is None for param in params)
    grads, versions, norms = left
    if not all(param.grad is grad and (grad is None or grad._version == version)
               for param, grad, version in zip(params, grads, versions)):
        return False
    now = _norms(grads)
    return now is None or bool(((now == norms) | (now.isnan() & norms.isnan())).all())


def grads_now(params) -> list:
    """Each parameter's .grad, its version counter and its norm, as the engine's own backward pass left them."""
    grads = [param.grad for param in params]
    return [grads, [None if grad is None else grad._version for grad in grads], _norms(grads)]


def _norms(grads: list) -> Tensor | None:
    """The norm of every .grad that is not None (one fused pass over the gradients), on the first one's device."""
    dense = [grad.detach() for grad in grads if grad is not None and grad.layout == torch.strided]
    sparse = [grad.detach().coalesce().values() for grad in grads if grad is not None and grad.layout != torch.strided]
    norms = list(torch._foreach_norm(dense)) if dense else []
    norms += [torch.linalg.vector_norm(values) for values in sparse]
    if not norms:
        return None
    device, dtype = norms[0].device, norms[0].dtype
    if any(norm.device != device or norm.dtype != dtype for norm in norms):  # (one stack when all alike)
        norms = [norm.to(device, torch.float64) for norm in norms]
    return torch.stack(norms)


def check_trainable_set(engine) -> None:
    """Every parameter the model would train must be in this plan (gradual unfreezing, a replaced head), and every
    planned parameter must still be the model's (``load_state_dict(assign=True)`` or a dtype conversion that makes
    new Parameter objects would leave the optimizer updating the old ones), still trained (a layer frozen since
    would be noised and updated) and of the dtype the probe proved (``model.double()`` converts in place)."""
    planned = set(engine.params)
    named = list(engine.model.named_parameters())
    present = {id(param) for _, param in named}
    names = engine.dp_optimizer.param_names
    for param in engine.params:
        problem = _changed_since_plan(engine, param, present)
        if problem is not None:
            engine.dp_optimizer.zero_grad()
            raise UserError(f"Parameter '{names.get(param, tuple(param.shape))}' {problem}; call engine.replan() "
                            "after changing the model (it re-runs the probe).")
    for name, param in named:
        if param.requires_grad and param not in planned:
            engine.dp_optimizer.zero_grad()
            raise UserError(f"Parameter '{name}' became trainable after the privacy engine planned its "
                            "clipping, so it has no clipped gradient; call engine.replan() after changing "
                            "what is trained (it re-runs the probe), or freeze it.")


def _changed_since_plan(engine, param, present: set) -> str | None:
    if id(param) not in present:
        return ("of the privacy engine's plan is no longer in the model (replaced by load_state_dict(assign=True), "
                "a dtype conversion or a new module), so the optimizer would update a stale copy")
    if frozen_since_plan(param, engine.clipping_mode):
        return ("was frozen after the privacy engine planned its clipping, so it would still be clipped, noised and "
                "updated")
    if param.dtype != engine.planned_dtypes.get(param, param.dtype):
        return (f"changed dtype from {engine.planned_dtypes[param]} to {param.dtype} after the privacy engine "
                "planned its clipping (the probe proved it at the old one)")
    return None


def refuse_foreign_step(engine, optimizer, args: tuple, kwargs: dict) -> None:
    """The step pre-hook on the optimizer handed to the engine: it updates only on the engine's privatized
    gradients, in every mode (a plain loss.backward() + optimizer.step() in ghost mode applied raw gradients)."""
    # A step at learning rate 0 with no gradient changes nothing: torch.distributed.checkpoint creates optimizer
    # state that way (zero gradients, lr 0) before loading a sharded checkpoint. With a gradient it is not inert:
    # momentum and Adam's moments would take in raw gradients that a later step applies.
    if engine.dp_optimizer.updating:  # the engine's own update: nothing to scan (no per-step cost)
        return
    inert = all(float(group.get("lr", 1.0)) == 0.0 and all(p.grad is None or not bool(p.grad.any())
                                                             for p in group["params"])
                for group in optimizer.param_groups)
    if not inert:
        raise UserError("The optimizer given to the privacy engine was stepped directly, which would apply "
                        "gradients the engine did not clip or noise; call engine.step() instead (or "
                        "engine.detach() to train without privacy).")


def parameter_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in model.named_parameters(remove_duplicate=False)}
