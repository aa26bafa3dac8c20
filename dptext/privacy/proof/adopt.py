"""A proof made before ``fully_shard`` taken by the engine built after it (``PrivacyEngine(..., verify=report)``)."""

from __future__ import annotations

from typing import Any

from dptext.errors import UserError

NOT_THIS_PLAN = ("The proof given as verify= was made on other layers or rules than this engine's plan ({}); prove "
                 "this model before fully_shard with the same clipping_mode and trainable layers, and pass that "
                 "report.")


def proof_plan(engine: Any) -> tuple:
    """The engine settings a proof holds for: the clipping mode, layout and long-sequence budget."""
    return (engine.clipping_mode, engine.clipping_layout, getattr(engine, "max_stored_bytes", None))


def adopt_proof(engine: Any, report: Any) -> None:
    """Take ``report``, a proof made by an engine on the same modules before ``fully_shard`` (which keeps each
    module object and changes where its weights live, not what the hooks record), as this engine's: refused unless
    it covers exactly this engine's tracked layers with the same rules and clipping settings and refused none of
    them. A refusal detaches ``engine`` first, so the model is left as it was given (no hooks, parameters in
    autograd)."""
    try:
        _check_adopted(engine, report)
    except UserError:
        engine.detach()
        raise
    # a training forward in other train/eval flags or under another autocast is proven again
    engine.plan_copies = None  # (kept for a probe this engine will not run)
    engine.verified, engine.proven_modes, engine.proven_autocast = True, report.modes or None, report.training_dtype
    engine.recorder.verified = set(engine.tracked)


def _check_adopted(engine: Any, report: Any) -> None:
    report.raise_if_refused()
    if report.plan != proof_plan(engine):
        raise UserError(NOT_THIS_PLAN.format(f"proved for clipping {report.plan}, this engine's is "
                                             f"{proof_plan(engine)}"))
    mine = {module: type(rule).__name__.removesuffix("Rule") for module, (rule, _) in engine.tracked.items()}
    theirs = {module: row.rule for module, row in report.rows.items()}
    if mine != theirs:
        differ = [engine.names[m] for m in mine if theirs.get(m) != mine[m]] + \
                 [row.name for m, row in report.rows.items() if m not in mine]
        raise UserError(NOT_THIS_PLAN.format("e.g. '" + "', '".join(differ[:3]) + "'"))
