"""Group single-reference records by their input, for multi-reference evaluation.

E2E and DART have several human references per input, stored one record per reference
(the natural unit for training). BLEU/ROUGE must score one generation per input against all
of its references, so evaluation regroups them here.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

# The input field of each table-to-text family, tried in this order when not given.
INPUT_FIELDS = ("mr", "tripleset")


def group_references(
    records: Sequence[dict[str, Any]],
    input_key: Optional[str] = None,
    ref_key: str = "ref",
    group_key: Optional[str] = None,
) -> list[dict[str, Any]]:
    """``[{"input": <mr or tripleset>, "refs": [ref, ...]}, ...]`` in first-seen order.

    Records sharing an input need not be adjacent. ``input_key`` defaults to ``mr`` (E2E) or
    ``tripleset`` (DART), whichever the records have. ``group_key`` says which field
    identifies an input; it defaults to ``entry`` where records have it (DART: 47 dev entries
    repeat another entry's triples but are separate inputs with their own references), else
    to the input itself (E2E's MR).
    """
    if not records:
        return []
    if input_key is None:
        input_key = next((k for k in INPUT_FIELDS if k in records[0]), None)
        if input_key is None:
            raise ValueError(f"records have none of the input fields {INPUT_FIELDS}; pass input_key=")
    if group_key is None:
        group_key = "entry" if "entry" in records[0] else input_key
    groups: dict[Any, dict[str, Any]] = {}
    for record in records:
        value = record[input_key]
        identity = record[group_key]
        if isinstance(identity, list):
            # Triple sets are nested lists; their JSON text is a faithful, hashable identity.
            identity = json.dumps(identity, ensure_ascii=False)
        group = groups.get(identity)
        if group is None:
            group = groups[identity] = {"input": value, "refs": []}
        group["refs"].append(record[ref_key])
    return list(groups.values())
