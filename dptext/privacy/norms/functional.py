"""Fallback for a trainable layer without a rule, in ``per_sample`` mode only: per-example gradients of its
own parameters by ``torch.func`` (vmap over the batch of a vector-Jacobian product of the layer alone).

It instantiates every per-example gradient, like opacus' functorch mode, so it is offered only where
instantiation is the point (the reference mode). The call is replayed as it was made: keyword arguments stay
keyword arguments (masks passed as ``attention_mask=``), and only tensors whose first dimension is the batch are
split per example; the rest (a (T, T) causal mask, a shared table) go to every example whole. Whether an input
is batched is learned once per layer and argument from a call whose shapes prove it (its first dimension is not
the batch size, or the batch size equals no other dimension: the probe's first batch has B ≠ T), so a later
batch with B = T cannot turn a (T, T) mask into per-example rows. Before it is learned (the probe off), a call
whose shapes cannot prove it is refused, never decided by shape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of


def _tensor_slots(args: tuple, kwargs: dict) -> list[tuple[object, Tensor]]:
    return [(i, x) for i, x in enumerate(args) if isinstance(x, Tensor)] + \
        [(k, x) for k, x in kwargs.items() if isinstance(x, Tensor)]


class FunctionalRule:
    num_inputs = None  # any call signature: the call is replayed as made
    takes_keywords = True

    def __init__(self):
        self.layout: dict[object, bool] = {}  # argument slot → carries the batch, learned where provable

    def keep(self, module: nn.Module, call: tuple) -> tuple:
        args, kwargs, rows = call
        slots = _tensor_slots(args, kwargs)
        # The first tensor is the layer's main input (the recorder checked that its output has one row per
        # example). Another tensor is batched if its first dimension is the batch, which its shape proves only
        # when the batch size equals no other dimension of the call: at B = T a (T, T) mask or a (T,) vector
        # looks batched. A tensor whose first dimension is not B is never batched.
        other_sizes = {size for _, x in slots for size in x.shape[1:]}
        batched, unproven = {slot for slot, _ in slots[:1]}, []
        for slot, x in slots[1:]:
            starts_with_batch = x.ndim > 0 and x.shape[0] == rows
            provable = not starts_with_batch or (rows > 1 and rows not in other_sizes)
            if slot in self.layout:
                carries = self.layout[slot]
                if provable and starts_with_batch and not carries:  # shared before ((1, T) ids), batched now
                    raise UserError(f"{type(module).__name__}'s input {slot!r} now carries the batch where it was "
                                    "shared by the batch before; freeze the layer or give it a rule.")
            elif provable:
                carries = self.layout[slot] = starts_with_batch
            else:  # one example: splitting a shared tensor of one row changes nothing, so either reading is exact
                carries = starts_with_batch
                if rows > 1:
                    unproven.append(slot)
            if carries:
                batched.add(slot)
        if unproven:
            raise UserError(f"{type(module).__name__} is called with a batch of {rows} that equals another "
                            f"dimension of its inputs, so whether {', '.join(map(repr, unproven))} carry the batch "
                            "cannot be proven from their shapes; run the start-up probe (privacy.verify / "
                            "engine.verify()), which learns it at B ≠ T, or freeze the layer.")
        for slot, x in slots:
            if slot in batched and (x.ndim == 0 or x.shape[0] != rows):
                raise UserError(f"{type(module).__name__}'s input {slot!r} no longer has the batch first; "
                                "freeze the layer or give it a rule.")
        return args, kwargs, frozenset(batched)

    def per_example(self, module, names, call, grad_output) -> dict[str, Tensor]:
        args, kwargs, batched = call
        params = {name: module.get_parameter(name).detach() for name in names}
        arg_slots = [i for i, x in enumerate(args) if isinstance(x, Tensor) and i in batched]
        kw_slots = [k for k, x in kwargs.items() if isinstance(x, Tensor) and k in batched]
        batched_args = tuple(args[i] for i in arg_slots)
        batched_kwargs = {k: kwargs[k] for k in kw_slots}

        def one_example(params, example_args, example_kwargs, example_grad):
            def forward(p):
                call_args = list(args)
                for i, x in zip(arg_slots, example_args):
                    call_args[i] = x.unsqueeze(0)
                call_kwargs = {**kwargs, **{k: x.unsqueeze(0) for k, x in example_kwargs.items()}}
                return torch.func.functional_call(module, p, tuple(call_args), call_kwargs)

            _, vjp = torch.func.vjp(forward, params)
            return vjp(example_grad.unsqueeze(0))[0]

        try:
            return torch.func.vmap(one_example, in_dims=(None, 0, 0, 0))(params, batched_args, batched_kwargs,
                                                                           grad_output)
        except RuntimeError as error:  # torch names the limit itself; the layer and the way out are ours to say
            if "setup_context" not in str(error):
                raise
            raise UserError(f"{type(module).__name__} calls a torch.autograd.Function written the old way (ctx in "
                            "forward, no setup_context staticmethod), which torch.func cannot replay for its "
                            "per-example gradients; give the Function a setup_context (torch's 'Extending "
                            "torch.func with autograd.Function') or freeze the layer.") from None

    def norm_sq(self, module, names, call, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, call, grad_output))

    def clipped_sum(self, module, names, call, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, call, grad_output), coef)
