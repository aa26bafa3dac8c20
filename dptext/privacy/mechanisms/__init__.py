"""Mechanisms other than DP-SGD's: engines that keep the DP-SGD engine's clipping, proof and checks
(``dptext.privacy.engine``) and change what is clipped or what noise is added, each with what it is accounted as.

- ``banded_mf``: banded matrix-factorization noise (SPEC §12) on cyclic balls-in-bins batches, and
  ``CorrelatedNoiseEngine``, what it shares with BLT.
- ``blt``: buffered-linear-Toeplitz correlated noise, d model-sized buffers however many steps.
- ``edp``: eDP-SGD (Dupuy et al. 2021) — micro-batches clipped as units, α-scaled noise; ``edp_accounting``: its
  description and noise floor; ``edp_scaling``: the choices of α.

The noise these draw is in ``dptext.privacy.noise`` (``correlated``), their samplers in ``dptext.privacy.sampling``
(``cyclic``), their accountants in ``dptext.accounting``.
"""
