"""The proof: how the engine shows, before any private example, that its clipping is exact for this model —
and, at every step, that nothing it did not see has changed since (docs/privacy_engine.md, "Fail closed").

- ``verify``: the start-up probe — the engine against brute-force per-example autograd on synthetic inputs.
- ``patterns``: use patterns — which tracked layers share one representative's numeric verdict, so the proof costs
  about one training step at any depth ("What the proof covers").
- ``probe_checks``: the probe's checks, one synthetic batch at a time (loss and row independence, clipped sums).
- ``stack``, ``vocabulary``: the second probe shape on the block stacks cut after their last block that differs and
  on the first rows of the vocabulary (the first shape runs on the whole model).
- ``sharded_probe``: the same probe on an FSDP2-sharded model, every rank together, no rank holding the whole model;
  ``cached_gathers``: a unit's later all-gathers there served from a copy of its first (within a budget).
- ``synthetic``, ``buffers``: the probe's synthetic batches and default loss; the state a training forward must
  leave alone.
- ``in_place``, ``outside_reads``: in-place changes and reads of tracked parameters outside their modules.
- ``step_checks``: the checks the engine makes at every step (the plan still holds, no foreign backward or hook).
- ``edp_probe``: the same proof for eDP-SGD's per-slot clipping.
- ``model_check``: ``dptext check --model``, the probe reported layer by layer.
"""
