"""Fallback for a trainable layer without a rule, in ``per_sample`` mode only: per-example gradients of its
own parameters by ``torch.func`` (vmap over the batch of a vector-Jacobian product of the layer alone).

It instantiates every per-example gradient, like opacus' functorch mode, so it is offered only where
instantiation is the point (the reference mode). It assumes the layer treats examples independently and
takes its batch first in every positional tensor argument.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.privacy.norms.instantiated import clipped_sum_of, norm_sq_of


class FunctionalRule:
    def keep(self, module: nn.Module, inputs: tuple) -> tuple:
        if not inputs or not all(isinstance(x, Tensor) for x in inputs):
            raise TypeError(f"{type(module).__name__} needs tensor positional inputs for the functional fallback")
        return tuple(inputs)

    def per_example(self, module, names, inputs, grad_output) -> dict[str, Tensor]:
        params = {name: getattr(module, name).detach() for name in names}

        def one_example(params, example_inputs, example_grad):
            def forward(p):
                batched = tuple(x.unsqueeze(0) for x in example_inputs)
                return torch.func.functional_call(module, p, batched)

            _, vjp = torch.func.vjp(forward, params)
            return vjp(example_grad.unsqueeze(0))[0]

        return torch.func.vmap(one_example, in_dims=(None, 0, 0))(params, inputs, grad_output)

    def norm_sq(self, module, names, inputs, grad_output) -> dict[str, Tensor]:
        return norm_sq_of(self.per_example(module, names, inputs, grad_output))

    def clipped_sum(self, module, names, inputs, grad_output, coef) -> dict[str, Tensor]:
        return clipped_sum_of(self.per_example(module, names, inputs, grad_output), coef)
