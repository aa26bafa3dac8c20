"""Noise: where clipped sums become a noisy update (SPEC §1).

- ``optimizer``: the DP optimizer — clipped sums in, Gaussian noise of std σ·C added once per step, one update out.
- ``parallel_noise``: drawing a whole model's noise on all CPU cores.
- ``correlated``: matrix-factorization noise (C⁻¹Z)_t: banded (a ring of b − 1 past noise vectors) or BLT (d
  decaying buffers).
- ``randomness``: one secret root of randomness with named children (noise, sampling, dropout never share a stream).
"""
