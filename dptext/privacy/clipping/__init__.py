"""Clipping: from a backward pass to per-example clipped sums, without per-example gradients (SPEC §1–2).

- ``plan``: which modules the engine tracks, with which rule (``dptext.privacy.norms``), and what the probe must prove.
- ``capture``: the hooks that record each tracked layer's inputs and output gradients per call.
- ``use``: one recorded call of a tracked layer (what ``capture`` records and ``sums`` reads).
- ``owned_params``: the planned parameters book-keeping takes out of autograd, and a freeze seen since.
- ``units``: privacy units — the rows that one clipping factor covers (examples, or users under user-level DP).
- ``sums``: from recorded uses to per-example norms, clipping coefficients and clipped sums.
- ``clipped_step``: one (micro-)batch's backward pass to clipped sums, in each clipping mode.

The per-layer rules themselves live in ``dptext.privacy.norms``; the proof that they are exact for a given model
in ``dptext.privacy.proof``.
"""
