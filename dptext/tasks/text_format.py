"""How records become model text: prompts for table-to-text and dialog, control-code prefixes.

Kept apart from tokenisation so a reader can see (and a test can pin) exactly which text a
model is trained on. Formats are plain and model-agnostic; the completion after the prompt
is the only part that carries loss.
"""

from __future__ import annotations

from typing import Any, Sequence

PROMPT_SUFFIX = "\nDescription:"
DIALOG_SUFFIX = "\nReply:"
CODE_SEPARATOR = " || "


def linearise_triples(tripleset: Sequence[Sequence[str]]) -> str:
    """DART triples as 'subject : predicate : object | ...' (the format of Li et al.'s code)."""
    return " | ".join(" : ".join(part.strip() for part in triple) for triple in tripleset)


def table_source(record: dict[str, Any]) -> str:
    """The structured input of an E2E (``mr``) or DART (``tripleset``) record as one line."""
    if "mr" in record:
        return record["mr"]
    if "tripleset" in record:
        return linearise_triples(record["tripleset"])
    if "input" in record:  # a grouped record from dptext.data.group_references
        value = record["input"]
        return value if isinstance(value, str) else linearise_triples(value)
    raise KeyError(f"a table-to-text record needs 'mr' or 'tripleset', got fields {sorted(record)}")


def table_prompt(record: dict[str, Any]) -> str:
    return table_source(record) + PROMPT_SUFFIX


def dialog_prompt(record: dict[str, Any], max_turns: int = 4) -> str:
    """The last ``max_turns`` turns of the history, one per line, then the reply cue."""
    history = list(record.get("history") or [])[-max_turns:]
    persona = record.get("persona") or []
    lines = [f"Persona: {p}" for p in persona] + history
    return "\n".join(lines) + DIALOG_SUFFIX


def control_code(record: dict[str, Any], fields: Sequence[str]) -> str:
    """'Category: books || Rating: 4' from the record's categorical fields (DistilDP, SPEC §6)."""
    missing = [f for f in fields if f not in record]
    if missing:
        raise KeyError(f"control-code fields {missing} are not in the record (fields: {sorted(record)})")
    return CODE_SEPARATOR.join(f"{field.replace('_', ' ').capitalize()}: {record[field]}" for field in fields)
