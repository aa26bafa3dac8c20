"""What ε covers: the one registry of every file a run directory or a synthetic-data folder may contain.

Each output is registered with a status:

* ``covered``     — a function of the DP-trained model / DP histogram and public inputs only: ε bounds what it
  reveals about any one training record.
* ``public``      — a public input copied into the output: the recipe, the pretrained model's tokenizer, the
  declared label sets and code domains, software versions.
* ``not_covered`` — computed from the private records without a DP mechanism (audit files, exact per-step
  losses, checkpoints holding the sampler's and noise generator's states); each entry says why.

Flags (``FLAG_REASONS``, from the recipe and from a teacher the output learnt from) take groups out of the
guarantee: every ``dp_result`` entry under ``GUARANTEE_FLAGS``, and the files holding ``train.seed`` under
``reproducible_noise``.

``write_manifest`` lists every file in ``release.json`` with its status and fails on one no entry matches (a
DPTrainer's output_dir, kind ``trainer``, lists it as not covered: other code writes there too); ``check_registered``
(``dptext.atomic``) refuses to write one. Patterns are ``fnmatch`` globs on the POSIX path relative to the folder;
the first match wins, so specific entries come before the catch-alls of their folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Iterable

from dptext.errors import UserError

COVERED, PUBLIC, NOT_COVERED = "covered", "public", "not_covered"
MANIFEST = "release.json"
ORIGIN = "model/dptext_origin.json"  # a run's flags inside its model folder (finetune.start_model)
STATUSES = {
    COVERED: "bounded by the run's (ε, δ): reveals about one training record at most what ε allows",
    PUBLIC: "a public input copied into the output (recipe, pretrained tokenizer, declared label sets, versions)",
    NOT_COVERED: "computed from private records without noise: keep it with the private data, never publish it",
}
# What takes an output's ``dp_result`` entries out of the guarantee, or makes its files holding train.seed secret
FLAG_REASONS = {
    "non_private": "the run trained without differential privacy (privacy.enabled=false): nothing it learnt is DP",
    "exact_codes": "control codes follow the EXACT private code distribution (--codes exact), which is not DP",
    "data_dependent_scaling": "eDP-SGD measured its scaling α on private training examples "
                              "(privacy.edp_scaling=first_step), a data-dependent choice no accountant covers",
    "reproducible_noise": "the sampler and noise were derived from train.seed (privacy.reproducible_noise=true): "
                          "anyone who knows the seed can regenerate the noise, so files that hold it stay secret",
    "seeded_noise": "PrivacyArguments.seed was given: the DPTrainer's sampler and noise are reproducible from it, "
                    "so the seed must stay as secret as the noise",
    "no_noise": "the steps were clipped but not noised (noise_multiplier=0): nothing the model learnt is DP",
    "upstream_reproducible_noise": "a teacher or start model this output learnt from drew its sampler and noise "
                                   "from its seed (privacy.reproducible_noise=true, or a seeded DPTrainer): the ε "
                                   "it hands on holds only while that seed stays secret",
    "continued_from_private_model": "the start model (model.name) was itself trained by dptext on private data: "
                                    "this run's ε covers only its own training; what the start model learnt keeps "
                                    "its own ε (its release.json), and where the two trained on the same records "
                                    "their ε compose",
    "clipping_not_verified": "clipping not verified: the start-up probe was switched off (privacy.verify=false), "
                             "so the clipping was never compared with brute-force per-example autograd and ε rests "
                             "on the layer rules alone",
}
# inherited by what learns from the output
GUARANTEE_FLAGS = ("non_private", "exact_codes", "data_dependent_scaling", "no_noise")
# inherited too, as a caveat on the ε that is handed on (statuses unchanged): what claims a teacher's ε says so
INHERITED_FLAGS = GUARANTEE_FLAGS + ("clipping_not_verified", "upstream_reproducible_noise",
                                     "continued_from_private_model")
# carried under another name: an upstream seed bounds the ε handed on, but what learns from it does not hold it
RENAMED_WHEN_INHERITED = dict.fromkeys(("reproducible_noise", "seeded_noise"), "upstream_reproducible_noise")


class UnregisteredOutput(UserError):
    """A file without a release status inside a run directory or synth folder: a bug in dptext when dptext chose
    the name (register it in dptext/release.py), a user's choice when the user named it (e.g. a --plot path)."""


@dataclass(frozen=True)
class Entry:
    pattern: str
    status: str
    what: str
    why: str = ""
    dp_result: bool = False  # derived from the DP mechanism: loses its cover under a flag of GUARANTEE_FLAGS
    holds_seed: bool = False  # holds train.seed: as secret as the noise under the reproducible_noise flag


_TOKENIZER = "the pretrained model's tokenizer, saved unchanged (never trained on the data)"
_MODEL_WEIGHTS = "weights and configuration of the model trained with DP-SGD"
_NOISY = "DP-SGD; post-processing of the noisy gradients"
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                    "chat_template.jinja")
_TOKENIZER_GIVEN = ("the tokenizer given to the Trainer, saved unchanged (public when it was not fitted on the "
                    "private data)")

RUN_ENTRIES = (
    Entry(MANIFEST, PUBLIC, "this manifest"),
    Entry("resolved.yaml", PUBLIC, "the recipe as it ran, with its declared label sets and code domains",
          holds_seed=True),
    Entry("provenance.json", PUBLIC, "git revision, package versions, command line, machine", holds_seed=True),
    Entry("ledger.json", COVERED, "q, σ per step, δ and ε per accountant",
          "functions of the settings and of n; n (the number of privacy units: training records, or users under "
          "privacy.unit=user) is treated as public, as in DP-SGD accounting; a user-level run's number of records "
          "is not (it goes to diagnostics_not_private.jsonl)", dp_result=True),
    Entry("mf_strategy.json", PUBLIC, "privacy.mechanism=banded_mf or blt: the strategy's coefficients (BLT: c0, "
          "ω, θ), steps and participation schema", "optimised from the recipe, the step count and n alone (n "
          "treated as public, as in ledger.json); no record is read"),
    Entry("metrics.jsonl", COVERED, "per logged step: step, epoch, ε spent; evaluation metrics",
          "ε depends on the settings only; evaluation scores are post-processing of the DP model on the "
          "evaluation split (which is not a training set: ε says nothing about its records)", dp_result=True),
    Entry("diagnostics_not_private.jsonl", NOT_COVERED,
          "per logged step: exact mean training loss, realised Poisson batch size, seconds; the run's total "
          "seconds (with those of journaled evaluation batches it did not redo)",
          "un-noised statistics of the sampled private batches: the batch size alone tells whether a record "
          "was sampled; under privacy.unit=user also the exact numbers of users and training records"),
    Entry("learning_curve_not_private.png", NOT_COVERED, "the learning curve (eval.learning_curve): training loss "
          "per step, the primary metric and ε per evaluation", "plots the exact per-step losses of "
          "diagnostics_not_private.jsonl"),
    Entry("result.json", COVERED, "final evaluation, privacy summary, settings", "as metrics.jsonl",
          dp_result=True),
    Entry("final_evaluation.jsonl", COVERED, "the final evaluation's finished batches (generated completions, "
          "perplexity sums, the seconds each took), kept so an interrupted evaluation resumes",
          "post-processing of the DP model on the evaluation split, as metrics.jsonl", dp_result=True),
    Entry("model/intent_slot_labels.json", PUBLIC, "the declared intents and BIO slot tags (task.intents, "
          "task.slot_types)"),
    Entry("model/clc_vocabulary.json", PUBLIC, "the clc encoder's fixed character set (no words of the data)"),
    *(Entry(f"model/{name}", PUBLIC, _TOKENIZER) for name in _TOKENIZER_FILES),
    Entry(ORIGIN, PUBLIC, "the run's flags, so that a copy of model/ says what it learnt", "settings, not records"),
    Entry("model/*", COVERED, _MODEL_WEIGHTS, _NOISY, dp_result=True),
    Entry("student_init/*", PUBLIC, "the student's initial weights, cut from a public pretrained model"),
    Entry("student.json", PUBLIC, "which layers of which public model the student keeps"),
    Entry("best.pt", COVERED, "the weights of the best periodic validation evaluation (train.keep_best)",
          "DP-trained weights at a step chosen on the validation split, which is not a training set",
          dp_result=True),
    Entry("checkpoints/LATEST", COVERED, "the step of the newest checkpoint"),
    Entry("checkpoints/*.pt", NOT_COVERED, "model, optimizer, sampler, noise-generator and RNG states for resuming",
          "the sampler's and noise generator's states regenerate the sampled batches and the noise; share "
          "model/ instead"),
    Entry("checkpoints/*.pt.sha256", NOT_COVERED, "the SHA-256 of each checkpoint, checked before a resume uses it",
          "a digest of a checkpoint, which is not covered"),
    Entry("audit_not_private/*", NOT_COVERED, "member / non-member / public records and canaries for `dptext mia`",
          "copies of the training records themselves"),
    Entry("mia_not_private/*", NOT_COVERED, "membership-inference reports, ROC plots and reference runs",
          "scores of individual training records and models trained without DP guarantees on their subsets"),
)

SYNTH_ENTRIES = (
    Entry(MANIFEST, PUBLIC, "this manifest"),
    Entry("plan.json", COVERED, "settings, the DP code histogram (noisy counts, sampling probabilities), the codes "
          "drawn from it, the validation indices", "Laplace/Gaussian histogram over the declared code domain",
          dp_result=True),
    Entry("chunks/part-*.jsonl", COVERED, "generated records, one batch per file",
          "sampled from the DP teacher, prompted with codes from the DP histogram", dp_result=True),
    Entry("train.jsonl", COVERED, "synthetic training records", "as chunks/", dp_result=True),
    Entry("validation.jsonl", COVERED, "synthetic validation records", "as chunks/", dp_result=True),
    Entry("summary.json", COVERED, "code coverage, lengths, duplicates, throughput of the synthetic records",
          "statistics of the synthetic data only (a count against private texts goes to training_copies_not_"
          "private.json)", dp_result=True),
    Entry("training_copies_not_private.json", NOT_COVERED, "how many synthetic texts copy a private training text",
          "compares with the private training texts exactly (--check-training-copies); for the data owner"),
    Entry("provenance.json", PUBLIC, "teacher run, its ε/δ, the code mechanism and its ε, software versions"),
    Entry("ledger.json", COVERED, "ε and δ spent: the teacher's DP-SGD run and the code histogram, composed",
          "functions of the settings", dp_result=True),
)

_TRAINER_STATISTICS = ("un-noised statistics of the sampled private batches: total_flos counts the tokens of the "
                       "batches drawn (every step's batch size with save_steps=1), train_runtime and throughput "
                       "follow the realised batch sizes, and the logged loss is the exact mean over the batch")
# dptext.integrations.DPTrainer's output_dir: the Trainer's own file names ("*" crosses "/": any checkpoint-N/)
TRAINER_ENTRIES = (
    Entry(MANIFEST, PUBLIC, "this manifest"),
    Entry("*privacy.json", COVERED, "q, σ, steps, δ, ε spent and the mechanism (the run's, and each checkpoint's)",
          "functions of the settings and of n (the training-set size, treated as public as in DP-SGD accounting)",
          dp_result=True),
    Entry("*trainer_state.json", NOT_COVERED, "the Trainer's state: log history with the per-step training loss, "
          "total_flos, train_runtime and throughput", _TRAINER_STATISTICS),
    Entry("*train_results.json", NOT_COVERED, "final training metrics (train_loss, train_runtime, total_flos, "
          "samples and steps per second)", _TRAINER_STATISTICS),
    Entry("*all_results.json", NOT_COVERED, "all saved metrics, the training ones included", _TRAINER_STATISTICS),
    Entry("*eval_results.json", COVERED, "evaluation metrics of the DP-trained model",
          "post-processing of the DP model on the evaluation data (not covered if that data is the training data)",
          dp_result=True),
    Entry("*rng_state*.pth", NOT_COVERED, "the training process's random generator states, kept for resuming",
          "states of the process that trained on the private batches; not needed to share the model"),
    Entry("*training_args.bin", PUBLIC, "the TrainingArguments (settings, no data)"),
    Entry("*optimizer.pt", COVERED, "optimizer state (moments of the noisy gradients)", _NOISY, dp_result=True),
    Entry("*scheduler.pt", PUBLIC, "the learning-rate schedule's state (a function of the step count)"),
    *(Entry(f"*{name}", PUBLIC, _TOKENIZER_GIVEN) for name in _TOKENIZER_FILES),
    *(Entry(weights, COVERED, _MODEL_WEIGHTS, _NOISY, dp_result=True) for weights in ("*.safetensors", "*.bin")),
    Entry("*config.json", COVERED, "model (adapter, generation) configuration of the DP-trained model", _NOISY,
          dp_result=True),
    Entry("*README.md", COVERED, "the model card a PEFT adapter is saved with", "written from the configuration",
          dp_result=True),
    Entry("*", NOT_COVERED, "a file DPTrainer does not know (another library's logs, your own files)",
          "dptext cannot tell what it holds"),
)

REGISTRIES = {"run": RUN_ENTRIES, "synth": SYNTH_ENTRIES, "trainer": TRAINER_ENTRIES}


def _match(pattern: str, relative: str) -> bool:
    # "dir/*" also covers everything below dir/ (fnmatch's * crosses "/") and the folder itself
    return fnmatch(relative, pattern) or (pattern.endswith("/*") and relative == pattern[:-2])


def entry_for(relative: str, kind: str) -> Entry:
    for entry in REGISTRIES[kind]:
        if _match(entry.pattern, relative):
            return entry
    raise UnregisteredOutput(f"'{relative}' has no release status in this {kind} output (release.json); write your "
                             "own files outside it (if dptext chose the name, register it in dptext/release.py).")


def status_of(entry: Entry, flags: Iterable[str]) -> tuple[str, str]:
    """(status, why) of ``entry`` under the output's flags."""
    lost = [FLAG_REASONS[f] for f in flags if f in GUARANTEE_FLAGS]
    if entry.dp_result and lost:
        return NOT_COVERED, "; ".join(lost)
    if entry.holds_seed and "reproducible_noise" in flags:
        return NOT_COVERED, FLAG_REASONS["reproducible_noise"]
    return entry.status, entry.why


def recipe_flags(recipe: Any) -> list[str]:
    """The flags a recipe sets before anything is trained (``FLAG_REASONS``)."""
    privacy = recipe.privacy
    if not privacy.enabled:
        return ["non_private"]
    flags = ["reproducible_noise"] if privacy.reproducible_noise else []
    if not privacy.verify:
        flags.append("clipping_not_verified")
    if privacy.method == "edp_sgd" and privacy.edp_scaling == "first_step":
        flags.append("data_dependent_scaling")
    return flags


def recipe_unit(recipe: Any) -> dict[str, Any] | None:
    """Whom a run's ε is about (the manifest's ``privacy_unit``): one example, or one user and the bound k; None
    for a non-private run (no ε)."""
    privacy = recipe.privacy
    if not privacy.enabled:
        return None
    if privacy.unit == "user":
        k = privacy.max_examples_per_user
        return {"unit": "user", "max_examples_per_user": k, "user_column": recipe.data.user_column,
                "text": f"ε is per user (≤ {k} examples each): one user is every training record with the same "
                        f"{recipe.data.user_column}"}
    return {"unit": "example", "text": "ε is per example: one training record"}


def inherited_flags(source: str | Path | None, listed: Iterable[str] | None = None) -> list[str]:
    """The guarantee flags of a run or synth folder whose outputs another output learns from (a teacher), or of
    ``listed``, the flags its manifest lists (a copied model folder's ``ORIGIN``)."""
    if listed is None:
        listed = ((read_manifest(source) if source else None) or {}).get("flags", {})
    flags = (RENAMED_WHEN_INHERITED.get(f, f) for f in listed)
    return list(dict.fromkeys(f for f in flags if f in INHERITED_FLAGS))


def _files(root: Path) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # staging folders of atomic writes
        for name in sorted(files):
            if not name.startswith("."):  # temp files of atomic writes
                found.append((Path(folder) / name).relative_to(root).as_posix())
    return found


def manifest(root: str | Path, kind: str, flags: Iterable[str] = (), unit: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The manifest of ``root``: every file with its status; raises UnregisteredOutput on an unknown file.
    ``unit`` (``recipe_unit``) says whom ε is about; a user-level run's covered files protect one user."""
    root, flags = Path(root), sorted(set(flags))
    statuses = dict(STATUSES)
    if (unit or {}).get("unit") == "user":
        statuses[COVERED] = statuses[COVERED].replace("one training record", "one user (all of their records)")
    files = []
    for relative in sorted(set(_files(root)) | {MANIFEST}):
        entry = entry_for(relative, kind)
        status, why = status_of(entry, flags)
        files.append({"path": relative, "status": status, "what": entry.what, **({"why": why} if why else {})})
    return {"kind": kind, "flags": {f: FLAG_REASONS[f] for f in flags}, "statuses": statuses,
            **({"privacy_unit": unit} if unit else {}), "files": files}


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    path = Path(root) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def check_registered(path: str | Path) -> Path | None:
    """Refuse to write ``path`` inside a folder that has a manifest when no entry of its kind lists it; returns
    that folder (the nearest one with a release.json), or None when ``path`` lies in no such folder."""
    path = Path(path).absolute()
    for root in list(path.parents)[:6]:
        found = read_manifest(root) if (root / MANIFEST).is_file() else None
        if found is not None:
            entry_for(path.relative_to(root).as_posix(), found.get("kind", "run"))
            return root
    return None
