"""The proof: how the engine shows, before any private example, that its clipping is exact for this model.

``patterns`` groups the tracked layers by *use pattern* (the same classes, parameters, rule and code path at the
same place of a repeated block), so the start-up probe (``dptext.privacy.verify``) compares one representative
of each pattern with brute-force per-example autograd and lets the others share its verdict, while every layer
still gets the structural checks. That keeps the proof's cost near one training step at any depth
(docs/privacy_engine.md, "What the proof covers").
"""
