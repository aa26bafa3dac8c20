"""Noise: where clipped sums become a noisy update (SPEC §1).

- ``optimizer``: the DP optimizer — clipped sums in, Gaussian noise of std σ·C added once per step, one update out.
- ``parallel_noise``: drawing a whole model's noise on all CPU cores.
- ``randomness``: one secret root of randomness with named children (noise, sampling, dropout never share a stream).
"""
