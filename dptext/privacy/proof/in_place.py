"""In-place changes of what a recorded layer use depends on: which are exact, and which are refused.

A gradient hook registered on a tensor before it is changed in place (``ReLU(inplace=True)``, ``out.mul_()``,
Falcon's ``+=``, Longformer's ``/=``) receives the gradient of the value before the change, which is what the weight
saw, so such changes are exact — provided the hook sits on the node
that produced the value. A layer's output is often a view (``F.linear`` on a (B, T, d) input returns a view of a
(B·T, p) matrix), and an in-place change of a view re-routes autograd around the view's node, so a hook there
would never fire and the use would silently vanish. The hook therefore goes on the view's base when the output is
a plain reshape of all of it (same elements, same order, produced by the node the view reads); an output that is
a view of anything else is refused if changed in place (version counter). The inputs the rule keeps share the
version counter of the call's inputs: an input changed in place after the layer read it stops the step.
Ghost clipping's first pass takes its gradients at the autograd edges recorded with the uses, not at the (possibly
changed) output tensors, whose current node would bypass the hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IN_PLACE = ("its output is a view of another tensor and is modified in place after the layer returns it, so "
            "autograd bypasses the node the recorded gradient belongs to")
INPUT_IN_PLACE = ("its input is modified in place after the layer read it, so the kept activation is not the one its "
                  "weight saw")


def gradient_site(output: Tensor) -> tuple[Tensor, bool]:
    """The tensor to hook for ``output``'s gradient, and whether its gradient must be viewed as ``output``.

    The base of a view that is a plain reshape of all of it (``F.linear`` on a (B, T, d) input: a view of the
    (B·T, p) product), whose node only that view reads from here: its gradient is the output's, reshaped, and an
    in-place change of the view cannot bypass it (it flows through CopySlices into the base's original node)."""
    base = output._base
    if base is None or base.grad_fn is None or output.grad_fn is None:
        return output, False
    whole = (base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous()
             and base.storage_offset() == output.storage_offset())
    reads_base = output.grad_fn.next_functions[:1] == ((base.grad_fn, 0),)
    return (base, True) if whole and reads_base else (output, False)


def tensors_in(kept: Any) -> list[Tensor]:
    """The tensors a rule kept (a tensor, or tuples/lists/dicts of them, as the fallback keeps a whole call)."""
    if isinstance(kept, Tensor):
        return [kept]
    if isinstance(kept, (tuple, list)):
        return [x for item in kept for x in tensors_in(item)]
    if isinstance(kept, dict):
        return [x for item in kept.values() for x in tensors_in(item)]
    return []


def in_graph(output: Tensor) -> Tensor:
    """``output``, made part of the graph when nothing upstream requires grad (book-keeping and per_sample take the
    weights out of autograd, so the first layer's output has no node): the backward pass must reach its hook.

    Plus a zero that requires grad, not ``output.requires_grad_()``: that would make the output a leaf, and a model
    that changes it in place (CTRL's ``inputs_embeds *= sqrt(d)``, DeBERTa's ``pos_query_layer /= ...`` on a view
    of it) would crash where plain autograd does not. The sum is the same values with a node of its own, so the
    in-place change is one a hook sees exactly (the module docstring)."""
    if output.requires_grad or not output.is_floating_point():
        return output
    return output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)
