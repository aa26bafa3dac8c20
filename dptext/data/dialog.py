"""Open-domain dialogs: the Chit Chat Challenge (``chitchat-dataset``) and Persona-Chat.

Records: one per response, ``{"dialog_id": str, "history": [earlier turns...], "response": str}``;
Persona-Chat records add ``"persona": [the responder's persona sentences]``.

Chit Chat (BYU PCC lab, 7,168 dialogs): read from the installed ``chitchat-dataset`` package's
``dataset.json`` (a dict of dialog id -> ``{"messages": [[{"text", "sender", ...}, ...], ...]}``,
each message being consecutive utterances by one sender, joined here with a space as the
package itself does). Every message after the first is a response to all earlier ones:
131,569 records. There is no official split, so dialogs (never single turns, which would
leak a dialog's context into another split) are assigned to train/validation/test by the
seeded partition. ``data.path`` may point to another ``dataset.json`` of the same format.

Persona-Chat (Zhang et al. 2018, the ConvAI2 ``personachat_self_original`` version used by
Li et al. 2021): hub ``AlekseyKorshuk/persona-chat`` (Parquet; train 17,878 dialogs ->
131,438 responses, validation 1,000 -> 7,801). Each utterance row has the dialog so far
(``history``) and candidate responses whose last one is the true response. ConvAI2's test
set is hidden, so ``test`` reads the official validation split, as Li et al. report.

Privacy unit: DP-SGD protects one *record*, and a record here is one message (the response) with the dialog so
far as its prompt. A message therefore also sits in the history of every later record of its dialog: removing
it changes its own record and up to every later one in that dialog, so the (ε, δ) of a run protects a single
record, while one message (or a whole dialog, or one speaker) of a dialog with k later turns is covered only by
group privacy over those k + 1 records (roughly (k+1)·ε, with δ growing too). Runs say so in ``result.json``
(``privacy.privacy_unit``); user-level DP (one dialog per unit) is not implemented.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

from dptext.data.files import existing_path
from dptext.data.hub import load_hub_split
from dptext.data.splits import canonical_split, seeded_split
from dptext.errors import UserError

PERSONACHAT_HUB_ID = "AlekseyKorshuk/persona-chat"
PERSONACHAT_TRAIN_SIZE = 131_438
PERSONACHAT_HUB_SPLITS = {"train": "train", "validation": "validation", "test": "validation"}


def chitchat_package_file() -> Path:
    """``dataset.json`` of the installed chitchat-dataset package, found without importing it."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The chitchat reader needs the chitchat-dataset package; run `pip install chitchat-dataset` "
                        "or pass data.path= to its dataset.json.")
    return Path(list(spec.submodule_search_locations)[0]) / "dataset.json"


def chitchat_responses(dialogs: dict[str, Any], source: Path) -> list[dict[str, Any]]:
    records = []
    for number, (dialog_id, dialog) in enumerate(dialogs.items(), start=1):
        try:
            turns = [" ".join(u["text"] for u in message) for message in dialog["messages"]]
        except (KeyError, TypeError):  # named by position: a dialog id is part of the (private) record
            raise UserError(f"{source} dialog {number} (counting from 1 in file order) has no messages of utterances "
                            "with a text; is it the chitchat-dataset dataset.json?") from None
        for position in range(1, len(turns)):
            records.append({"dialog_id": dialog_id, "history": turns[:position], "response": turns[position]})
    return records


def read_chitchat_all(path: Optional[str]) -> list[dict[str, Any]]:
    source = existing_path(path, "chitchat") if path is not None else chitchat_package_file()
    if source.is_dir():
        source = source / "dataset.json"
    try:
        dialogs = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"Could not read the chitchat dialogs from {source} ({exc}); pass its dataset.json.") from None
    if not isinstance(dialogs, dict):
        raise UserError(f"{source} is not a chitchat-dataset file (expected a JSON object of dialogs).")
    return chitchat_responses(dialogs, source)


def read_chitchat(split: str, path: Optional[str] = None, validation_fraction: float = 0.1, split_seed: int = 0,
                  **_options) -> list[dict[str, Any]]:
    return seeded_split(read_chitchat_all(path), split, lambda r: r["dialog_id"], validation_fraction, split_seed)


def personachat_responses(dialogs: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    records = []
    for index, dialog in enumerate(dialogs):
        utterances = dialog["utterances"]
        if isinstance(utterances, dict):  # a sequence of structs may arrive as a dict of lists
            utterances = [dict(zip(utterances, values)) for values in zip(*utterances.values())]
        for utterance in utterances:
            records.append({
                "dialog_id": f"{split}-{index}",
                "persona": list(dialog["personality"]),
                "history": list(utterance["history"]),
                "response": utterance["candidates"][-1],
            })
    return records


def _personachat_json(path: Optional[str], split: str) -> list[dict[str, Any]]:
    """A local ``personachat_self_original.json`` (``{"train": [...], "valid": [...]}``)."""
    source = existing_path(path, "personachat")
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"Could not read Persona-Chat from {source} ({exc}); "
                        "pass personachat_self_original.json.") from None
    key = "train" if split == "train" else "valid"
    if not isinstance(data, dict) or key not in data:
        raise UserError(f"{source} has no {key!r} list; expected personachat_self_original.json.")
    return data[key]


def read_personachat(split: str, path: Optional[str] = None, **_options) -> list[dict[str, Any]]:
    split = canonical_split(split)
    hub_split = PERSONACHAT_HUB_SPLITS[split]
    if path is not None:
        return personachat_responses(_personachat_json(path, split), hub_split)
    return personachat_responses(load_hub_split("personachat", PERSONACHAT_HUB_ID, hub_split), hub_split)
