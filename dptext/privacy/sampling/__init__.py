"""Sampling: which examples (or users) form each logical batch — the part of the mechanism that amplification
by subsampling accounts for (SPEC §3).

- ``sampler``: Poisson sampling (what the accountant assumes) and shuffling (accounted as such, never as Poisson).
- ``user_sampler``: user-level Poisson sampling, the privacy unit being a user with all of their examples.
- ``cyclic``: balls-in-bins batches with a minimum separation, the (k, P)-participation banded MF and BLT noise
  are accounted for (no amplification claimed).
"""
