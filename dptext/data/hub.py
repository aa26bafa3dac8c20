"""Loading a split from the Hugging Face hub, with failures turned into one-sentence errors.

Users have the hub; dptext's own machines and CI do not. Every reader therefore keeps real
``datasets.load_dataset`` code, and any failure there (no network, a renamed repository, a
missing split) becomes a ``UserError`` that says what failed and how to use a local copy.
"""

from __future__ import annotations

from typing import Any, Optional

from dptext.errors import UserError

# Several canonical datasets (e2e_nlg, dart) still ship a loading script on their main
# branch, which ``datasets`` 4+ refuses to run. The hub keeps an automatic Parquet export
# of every dataset on this branch, laid out as ``<config>/<split>/NNNN.parquet``.
PARQUET_EXPORT = "refs/convert/parquet"


def load_hub_split(
    dataset: str,
    hub_id: str,
    split: str,
    *,
    config: Optional[str] = None,
    revision: Optional[str] = None,
    data_dir: Optional[str] = None,
) -> list[dict[str, Any]]:
    """Rows of one split of a hub dataset as plain dicts.

    ``dataset`` is dptext's name for it (used in the error message); ``hub_id``/``config``
    are the hub's. ``split`` is the hub's split name, e.g. ``validation_matched``.
    """
    try:
        import datasets  # datasets loads in seconds and only hub reads (never offline files) need it

        kwargs: dict[str, Any] = {"split": split}
        if revision is not None:
            kwargs["revision"] = revision
        if data_dir is not None:
            kwargs["data_dir"] = data_dir
        rows = datasets.load_dataset(hub_id, config, **kwargs)
        return [dict(row) for row in rows]
    except (KeyboardInterrupt, UserError):
        raise
    except Exception as exc:  # network, missing repo or split, incompatible datasets version
        reason = _first_line(exc)
        where = f"{hub_id}" + (f" ({config})" if config else "")
        raise UserError(
            f"Could not load the {split} split of {dataset} from the Hugging Face hub dataset {where} "
            f"({type(exc).__name__}: {reason}); pass data.path= (or --path) pointing to a local copy instead."
        ) from exc


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
    text = text.rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."
