"""The privacy settings every engine checks at construction, before it touches the model or any data."""

from __future__ import annotations

from dptext.accounting.pld import MIN_SIGMA
from dptext.errors import UserError


def check_settings(noise_multiplier: float, max_grad_norm: float, floor: float = MIN_SIGMA) -> None:
    """σ ≥ 0 and C > 0; σ = 0 is allowed (clipping tests, recorded as no noise), but 0 < σ < ``floor`` is
    refused: ε there is astronomically large and beyond the accountants' grids (a PLD of σ = 1e-9 would need more
    memory than any machine has), as the recipe's bound on ``privacy.noise_multiplier`` says. ``floor``: the
    smallest σ whose accounted multiplier reaches ``MIN_SIGMA`` (eDP-SGD accounts z_0 / 2)."""
    if noise_multiplier < 0 or max_grad_norm <= 0:
        raise UserError("noise_multiplier must be ≥ 0 and max_grad_norm > 0.")
    if 0 < noise_multiplier < floor:
        raise UserError(f"noise_multiplier={noise_multiplier:g} is below {floor:g}, where ε is astronomically large "
                        f"and no accountant can compute it; use a noise multiplier of at least {floor:g} (or 0 to "
                        "test clipping alone).")
