"""Sharding: DP training over several processes (docs/sharding.md).

- ``distributed``: data-parallel DP — one process per device, clipped sums all-reduced, noise drawn once.
- ``sharded``: the DP step when the model is sharded with FSDP2 (each rank noises its own shard).
- ``sharded_filter``: correlated noise's per-rank filter state (banded MF, BLT) in the sharded checkpoint.
- ``cyclic_ranks``: the cyclic bins of banded MF / BLT, the same on every rank, each rank training its members.
- ``fsdp_controls``: what dptext sets on FSDP2's own modules (gradient sync, reduce-scatter) around the DP step.
"""
