"""The run directory: everything a run leaves behind, written so it can never be half-written.

Layout of ``runs/<recipe>-<timestamp>/`` (or ``--out``)::

    resolved.yaml        the recipe after defaults and overrides (what actually ran)
    provenance.json      git revision, package versions, command line, machine
    metrics.jsonl        one JSON object per logged step / evaluation: step, ε spent, evaluation metrics
    diagnostics_not_private.jsonl   per-step loss, realised batch size, clock; the run's seconds (NOT covered by ε)
    ledger.json          privacy state: q, σ per step, δ, ε per accountant
    checkpoints/         step-00000123.pt files, their .sha256 checksums, and LATEST, each written atomically
    result.json          the final summary, written when the run completes
    release.json         every file above with its release status (``dptext.release``)

Only files registered in ``dptext.release`` may be written: ``atomic_write`` refuses any other inside a folder that
has a ``release.json`` (and rewrites that manifest after each file it writes there), and ``write_manifest`` fails on
an unregistered file it finds. Every file is written to a temporary name in the same folder, flushed, fsynced and
renamed over the target (``dptext.atomic``), so a crash, Ctrl-C or a full disk (one sentence,
``dptext.errors.no_space_error``) leaves the old file or the new one, never a torn one. One process writes a run at
a time (``dptext.locking``: a lock on the folder itself). ``--resume DIR`` continues from the newest checkpoint that
verifies (``dptext.checkpoint_files``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from dptext import release
from dptext.atomic import (append_json_line, atomic_directory, atomic_write, atomic_write_json,  # noqa: F401
                           atomic_write_text, write_manifest)  # (re-exported: the run's writers, used everywhere)
from dptext.checkpoint_files import HashingWriter, checksum_path, load_newest_valid
from dptext.config import dump_recipe, load_recipe
from dptext.errors import UserError
from dptext.locking import lock_folder
from dptext.locking import release as release_lock
from dptext.textfiles import read_json, read_lines, visible_entries
from dptext.provenance import provenance

RESOLVED = "resolved.yaml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
DIAGNOSTICS = "diagnostics_not_private.jsonl"
LEDGER = "ledger.json"
RESULT = "result.json"
FINAL_EVALUATION = "final_evaluation.jsonl"  # the final evaluation's finished batches (dptext.tasks.eval_journal)
MODEL_DIR = "model"  # the trained model (or LoRA adapters) a finished run exports
CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
STAGING = re.compile(r"\.[^.].*-[a-z0-9_]{8}")  # atomic_directory's tempfile.mkdtemp(prefix=".NAME-") folders


def origin(flags: Any) -> dict[str, Any]:
    """The content of a run's ``model/dptext_origin.json`` (``release.ORIGIN``): the run's flags."""
    return {"written_by": "dptext", "kind": "run", "flags": sorted(set(flags))}


class RunDir:
    """One run's directory. Create with ``RunDir.create``; reopen for resume with ``RunDir.open``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, recipe: Any, out: str | Path | None = None, root: str | Path | None = None) -> "RunDir":
        """Make a fresh run directory and write the resolved recipe and provenance.

        Without ``out`` it is ``<root>/<recipe.name>-<timestamp>``; root defaults to
        ``$DPTEXT_RUNS_ROOT`` or ``runs``.
        """
        root = root or os.environ.get("DPTEXT_RUNS_ROOT", "runs")

        if out is None:
            if Path(recipe.name).name != recipe.name or recipe.name in ("", ".", ".."):  # would leave runs/
                raise UserError(f"Recipe name {recipe.name!r} is not a plain folder name; give a name without '/' "
                                "or '..' (the run goes to runs/<name>-<timestamp>), or choose the folder with --out.")
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            out = Path(root) / f"{recipe.name}-{stamp}"
            suffix = 1
            while out.exists():
                suffix += 1
                out = Path(root) / f"{recipe.name}-{stamp}-{suffix}"
        out = Path(out)
        missing = [folder for folder in (out, *out.parents) if not folder.exists()]  # what a failure takes back
        try:
            lock_folder(out)  # one writer: a second `--out` or `--resume` of this folder is refused from here on
            if not cls(out).reusable() and visible_entries(out):
                raise UserError(f"Run directory '{out}' already exists and is not empty; "
                                f"pass --resume {out} to continue it or choose another --out.")
            run = cls(out)
            atomic_write_text(run.path / RESOLVED, dump_recipe(recipe))
            atomic_write_json(run.path / PROVENANCE, provenance())
            write_manifest(run.path, "run", release.recipe_flags(recipe), release.recipe_unit(recipe))
        except OSError as error:  # an --out under a file, a read-only or full disk: nothing is left half-written
            release_lock(out)
            for folder in missing:  # deepest first
                shutil.rmtree(folder, ignore_errors=True)
            raise UserError(f"The run directory '{out}' cannot be written ({error.strerror or error}); choose "
                            "another --out.") from None
        return run

    @classmethod
    def open(cls, path: str | Path) -> "RunDir":
        """Reopen an existing run (for --resume or for reading its results)."""
        run = cls(path)
        if not (run.path / RESOLVED).is_file():
            raise UserError(f"'{path}' is not a dptext run directory (no {RESOLVED}); "
                            "pass the folder a previous run printed.")
        return run

    def lock(self) -> "RunDir":
        """Become the folder's one writer (``dptext.locking``), or refuse in one sentence; returns self."""
        lock_folder(self.path)
        self._remove_dead_temporaries()
        return self

    def _remove_dead_temporaries(self) -> None:
        """What a kill left of an atomic write (the target itself is whole, old or new): ``atomic_write``'s temporary
        files (``.NAME.<8 random characters>.tmp``) here and in checkpoints/, and ``atomic_directory``'s staging
        folders in the run folder (``.model-<8 random characters>``: a whole model copy each). Only the folder's
        lock holder calls this, so no live writer owns one; FSDP2's checkpoint staging is ``sharded_checkpoint``'s."""
        for folder in (self.path, self.checkpoint_dir):
            for stale in folder.glob(".*.tmp"):
                if stale.is_file():
                    stale.unlink(missing_ok=True)
        for stale in self.path.glob(".*-*"):
            if stale.is_dir() and STAGING.fullmatch(stale.name):
                shutil.rmtree(stale, ignore_errors=True)

    def reusable(self) -> bool:
        """A run directory whose run never started: no checkpoint, no metrics, no result (only what
        ``create`` writes, e.g. after a kill during loading). A new run may take it over."""
        names = set(visible_entries(self.path))
        return RESOLVED in names and names <= {RESOLVED, PROVENANCE, release.MANIFEST, "audit_not_private"}

    def remove_unstarted(self, keep_folder: bool = False) -> None:
        """Undo ``create`` after a failed start, so a failed start leaves nothing behind (``keep_folder``: the
        folder itself existed, empty, before the run)."""
        if not self.reusable():
            return
        shutil.rmtree(self.path, ignore_errors=True)
        release_lock(self.path)
        if keep_folder:
            self.path.mkdir(parents=True, exist_ok=True)

    def recipe(self) -> Any:
        return load_recipe(self.path / RESOLVED)

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, record: dict[str, Any], name: str = METRICS) -> None:
        """Append one JSON line to ``name``; flushed and fsynced so a crash loses at most this line."""
        append_json_line(self.path / name, record)

    def log_diagnostics(self, record: dict[str, Any]) -> None:
        """Un-noised statistics of private batches (exact loss, realised batch size): not covered by ε."""
        self.log_metrics(record, DIAGNOSTICS)

    def read_metrics(self, name: str = METRICS) -> list[dict[str, Any]]:
        path = self.path / name
        if not path.exists():
            return []
        records = []
        for line in read_lines(path):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by a crash mid-write
                continue
        return records

    def truncate_metrics_after(self, step: int) -> None:
        """On resume, drop records logged after the checkpoint we resume from (they will be redone)."""
        for name in (METRICS, DIAGNOSTICS):
            kept = [r for r in self.read_metrics(name) if r.get("step", 0) <= step]
            atomic_write_text(self.path / name, "".join(json.dumps(r) + "\n" for r in kept))

    # ------------------------------------------------------------------ privacy ledger and result
    def save_ledger(self, ledger: dict[str, Any]) -> None:
        atomic_write_json(self.path / LEDGER, ledger)

    def load_ledger(self) -> dict[str, Any] | None:
        return read_json(self.path / LEDGER, "the privacy ledger")

    def save_result(self, result: dict[str, Any], flags: Any = None) -> None:
        """The final summary, then the release manifest of everything the run wrote (``flags``: see
        ``dptext.release.FLAG_REASONS``; None keeps the manifest's)."""
        atomic_write_json(self.path / RESULT, result)
        write_manifest(self.path, "run", flags)
        if (self.path / "model").is_dir():  # a copy of model/ made outside the run still says what it learnt
            atomic_write_json(self.path / release.ORIGIN, origin((release.read_manifest(self.path) or {}).get(
                "flags", {})))

    def load_result(self) -> dict[str, Any] | None:
        return read_json(self.path / RESULT, "the run's result")

    def finished_seconds(self) -> float | None:
        """Wall seconds of the invocation that finished the run: the diagnostics' ``finished`` record (runs write
        it there, not into the covered result.json, since it is a timing side channel), or an older run's
        result.json ``seconds``; None for an unfinished run."""
        finished = [r["total_seconds"] for r in self.read_metrics(DIAGNOSTICS) if r.get("event") == "finished"]
        if finished:
            return finished[-1]
        return (self.load_result() or {}).get("seconds")

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINTS

    def save_checkpoint(self, state: dict[str, Any], step: int, keep: int = 2) -> Path:
        """Atomically write ``state`` (model, optimizer, sampler, RNG, ledger...) for ``step``, with its SHA-256.

        LATEST is updated only after the checkpoint file and its checksum are complete, and older
        checkpoints are pruned only after that, so there is always one complete one.
        """
        import torch  # lazily: light commands (`dptext account`, `check`) use runs.py

        target = self.checkpoint_dir / f"step-{step:08d}.pt"
        writers: list[HashingWriter] = []

        def write(handle: Any) -> None:
            writers.append(HashingWriter(handle))
            torch.save({"step": step, **state}, writers[-1])

        atomic_write(target, write, binary=True)
        atomic_write_text(checksum_path(target), writers[-1].sha.hexdigest() + "\n")
        atomic_write_text(self.checkpoint_dir / LATEST, target.name + "\n")
        for old in sorted(self.checkpoint_dir.glob("step-*.pt"))[:-keep]:
            old.unlink()
            checksum_path(old).unlink(missing_ok=True)
        write_manifest(self.path)  # fails if the run wrote a file without a release status
        return target

    def latest_checkpoint(self) -> Path | None:
        pointer = self.checkpoint_dir / LATEST
        if not pointer.exists():
            return None
        target = self.checkpoint_dir / pointer.read_text().strip()
        return target if target.exists() else None

    def load_checkpoint(self, map_location: Any = "cpu", say: Callable[[str], None] | None = None) -> Any:
        """The newest checkpoint that verifies (``dptext.checkpoint_files``); None for a run without one."""
        import torch  # lazily: light commands (`dptext account`, `check`) use runs.py

        pointer = self.checkpoint_dir / LATEST
        latest = pointer.read_text(encoding="utf-8", errors="replace").strip() if pointer.is_file() else None
        # Checkpoints hold optimizer and RNG state (numpy arrays, tuples), so they are
        # not restricted to tensors; only load run directories you created.
        return load_newest_valid(self.checkpoint_dir, latest,
                                 lambda path: torch.load(path, map_location=map_location, weights_only=False), say)
