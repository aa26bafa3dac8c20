"""Recipe schema, YAML loading and dotted overrides.

A recipe is pure data: a YAML file whose sections map onto the dataclasses below. Every
field has its default and its documentation here, in one place (``doc`` metadata), and
nowhere else: engine code reads ``recipe.privacy.max_grad_norm``, never
``cfg.get("max_grad_norm", 0.1)``.

Loading is strict: unknown keys are errors that name the nearest valid key, values are
checked against the field types (``Literal`` choices, numbers, optional fields), and
command-line overrides such as ``privacy.target_epsilon=3`` go through the same checks.

Settings that change the privacy guarantee (σ, C, q, steps, δ) live in ``privacy`` and
``train.batch_size``/``train.epochs``; settings that cannot (micro-batch size, clipping
mode, dtype) are marked as such in their docs.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from dptext.constraints import bounds_text, check_relations, check_value
from dptext.errors import UserError


def doc(default: Any, text: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, excludes: str | None = None, only_with: tuple[str, Any] | None = None) -> Any:
    """A dataclass field with a default, its user-facing documentation and its declared constraints.

    ``ge``/``gt``/``le``/``lt`` bound a number (checked on load, shown by `dptext check --schema`); ``excludes``
    names a key that must not also be set (the two are alternatives); ``only_with=(key, value)`` says a
    non-default value only means something when ``key`` has ``value``. Declared here, once, so every key added
    later is checked the same way (see ``dptext.constraints``).
    """
    metadata = {"doc": text, "bounds": (ge, gt, le, lt), "excludes": excludes, "only_with": only_with}
    if isinstance(default, (list, dict)):
        factory = (lambda d: (lambda: type(d)(d)))(default)
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, text: str) -> Any:
    """A recipe section: a nested schema dataclass, defaulting to its own defaults."""
    return field(default_factory=cls, metadata={"doc": text})


@dataclass
class ModelConfig:
    name: str = doc("smollm2-135m", "Hub name (gpt2, roberta-base), local folder, or offline alias "
                    "(smollm2-135m, minilm-l6, tiny-gpt2, tiny-llama, tiny-bert, tiny-roberta; clc, tiny-clc: "
                    "the bi-LSTM of task.type=intent_slot).")
    adaptation: Literal["full", "lora", "bias", "top_n", "retrain"] = doc(
        "full", "Which parameters train: all (full), LoRA adapters, biases only, the top N layers, or all from a "
        "random initialisation (retrain), as in Li et al. Table 2.")
    lora_rank: int = doc(8, "LoRA rank r (adaptation=lora).", ge=1)
    lora_alpha: float = doc(16.0, "LoRA scaling alpha (adaptation=lora).", gt=0)
    top_n_layers: int = doc(2, "Number of top transformer layers to train (adaptation=top_n; 0: only the head).", ge=0)
    untie_embeddings: bool = doc(False, "Give the LM head its own copy of the input embedding. Off by default: "
                                 "dptext clips tied weights exactly.")


@dataclass
class DataConfig:
    dataset: Optional[str] = doc(None, "Dataset reader: e2e, dart, sst2, qnli, mnli, qqp, atis, snips, amazon, "
                                 "imdb, yelp, chitchat, personachat, news, jsonl, csv, tsv (`dptext data --help`). "
                                 "Empty: jsonl/csv/tsv from data.path's extension, e2e when no path is set.")
    path: Optional[str] = doc(None, "Local file or folder to read; empty means the Hugging Face hub "
                              "(or the installed package for imdb/chitchat/news).")
    text_column: Optional[str] = doc(None, "Text column for generic jsonl/csv data.")
    label_column: Optional[str] = doc(None, "Label column for generic jsonl/csv data.")
    max_train_examples: Optional[int] = doc(None, "Use only the first N training examples (after the seeded split).", ge=1)
    max_eval_examples: Optional[int] = doc(None, "Evaluate on only the first N validation/test examples.", ge=0)
    sample_seed: Optional[int] = doc(None, "Take max_train_examples / max_eval_examples as a seeded random sample "
                                     "of the split (kept in file order) instead of its first N records; files "
                                     "sorted by class or category need it for a representative slice.", ge=0)
    max_length: int = doc(128, "Maximum tokens per example; longer examples are truncated.", ge=1)
    validation_fraction: float = doc(0.1, "Held-out fraction when the source has no validation split.", ge=0, lt=1)
    split_seed: int = doc(0, "Seed of the deterministic split for sources without official splits.", ge=0)


@dataclass
class TaskConfig:
    type: Literal["table_to_text", "dialog", "language_modeling", "classification", "infilling", "intent_slot"] = doc(
        "table_to_text", "Training objective and evaluation.")
    loss_reduction: Literal["sum", "mean"] = doc(
        "mean", "How each example's token losses are reduced: summed, or averaged over that example's own tokens.")
    pooling: Literal["model", "mean"] = doc(
        "model", "Input of a classification (or intent_slot intent) head: the model's own (BERT: pooled [CLS]) "
        "or the masked mean of the last hidden states (what sentence-transformers models such as minilm-l6 are "
        "trained for).")
    template: Optional[str] = doc(None, "Infilling template override, e.g. '<S1> It was [MASK] .' (default: SPEC §8).")
    label_words: list = doc([], "Infilling label words in label order (default: SPEC §8 for the task).")
    control_codes: list = doc([], "Record fields prepended as control codes, e.g. [category, rating].")
    labels: list = doc([], "classification: the classes in label order, a public input taken from the dataset's "
                       "documentation, never read from the records; a label equal to a class is that class, an "
                       "integer label indexes the list. Empty: the dataset's published label names (sst2, imdb, "
                       "...); your own files must declare them.")
    intents: list = doc([], "intent_slot: the declared intents (public, from the dataset's documentation).")
    slot_types: list = doc([], "intent_slot: the declared slot types; the BIO tags are O, B-<type> and I-<type>.")
    other_label: Optional[str] = doc(None, "A declared class or intent that training records with a label outside "
                                     "the declared set are mapped to (their undeclared slot tags become O); empty "
                                     "refuses such a record before training, naming its position.")
    code_domain: dict = doc({}, "Every value each control-code field can take, declared from public documentation, "
                            "e.g. {rating: [1, 2, 4, 5]}; `dptext synth` draws codes from a DP histogram over it.")
    crf: bool = doc(False, "intent_slot: a linear-chain CRF slot layer over the words (its transitions are clipped "
                    "and noised like every other parameter) instead of per-token softmax.")


@dataclass
class PrivacyConfig:
    enabled: bool = doc(True, "Train with differential privacy; false gives the non-private baseline of the same recipe.")
    target_epsilon: Optional[float] = doc(8.0, "Target ε for the whole run; σ is calibrated to it.", gt=0)
    delta: Optional[float] = doc(None, "Target δ; empty means 1/(2n) for n training examples (Li et al.).", gt=0, lt=1)
    noise_multiplier: Optional[float] = doc(None, "Use this σ instead of calibrating from target_epsilon.", gt=0,
                                            excludes="privacy.target_epsilon")
    max_grad_norm: float = doc(0.1, "Per-example clipping norm C (Li et al. use 0.1).", gt=0)
    accountant: Literal["rdp", "prv", "pld", "gdp"] = doc(
        "rdp", "Accountant that calibrates σ and reports the run: rdp, prv (its upper bound) or pld; all four are "
        "reported, but gdp (a CLT approximation, not a bound) is refused for training.")
    sampling: Literal["poisson", "shuffle"] = doc(
        "poisson", "Batch sampling. Only poisson matches the accounting, so a private run refuses shuffle; a "
        "non-private baseline (enabled=false) may shuffle.")
    clipping_mode: Literal["bookkeeping", "ghost", "per_sample"] = doc(
        "bookkeeping", "How clipped sums are computed (does not change privacy): one backward pass (bookkeeping), "
        "two (ghost), or instantiated per-example gradients (per_sample, the reference).")
    clipping_layout: Literal["all_layer", "per_layer"] = doc(
        "all_layer", "One norm over the whole model, or a threshold per layer (group-wise clipping).")
    method: Literal["dp_sgd", "edp_sgd"] = doc(
        "dp_sgd", "DP-SGD with per-example clipping, or eDP-SGD (Dupuy et al., SPEC §4): each process's micro-batch "
        "gradient is clipped as one unit (sensitivity 2C, accounted as noise multiplier z/2); see docs/edp.md. "
        "For edp_sgd, noise_multiplier is z_0 (noise std / C), and target_epsilon calibrates z_0 for the whole "
        "decaying schedule.")
    edp_micro_batches_per_device: int = doc(
        1, "edp_sgd: clipping units (micro-batch slots) per process; an example's slot is a keyed hash of its record "
        "(never its position), so removing one record moves only its own slot. More slots = more signal per step, "
        "one backward pass each.", ge=1)
    edp_scaling: Literal["uniform", "public", "first_step"] = doc(
        "uniform", "edp_sgd: per-parameter-tensor scaling α (clip and noise in the α-scaled space): uniform α=1, "
        "measured on public examples (edp_public_path; no privacy cost), or on the first private training "
        "examples as in the paper (first_step: data-dependent, NOT covered by ε; labelled as leaking).")
    edp_public_path: Optional[str] = doc(
        None, "edp_scaling=public: file or folder of PUBLIC examples in the training data's format (read with "
        "data.dataset's reader, its train split); they must not be private data.")
    edp_public_examples: int = doc(64, "edp_sgd: examples whose mean gradient at the initial weights measures α "
                                   "(public or first_step scaling).", ge=1)
    noise_decay: Literal["none", "linear", "exponential"] = doc(
        "none", "edp_sgd: noise decay by epoch t = step // round(1/q): z_t = z_0, z_0/(1+τt) or z_0·e^(−τt).",
        only_with=("privacy.method", "edp_sgd"))
    noise_decay_rate: float = doc(0.0, "edp_sgd: the decay rate τ of noise_decay.", ge=0,
                                  only_with=("privacy.method", "edp_sgd"))
    reproducible_noise: bool = doc(
        False, "Derive the sampler and noise from train.seed so a run can be repeated exactly. Off by default: "
        "they come from a secret os.urandom root that is never written to the run directory. When on, the "
        "guarantee holds only while train.seed stays secret, and the summary, ledger and `dptext account` say so.")
    secure_rng: bool = doc(False, "Also re-seed the noise from os.urandom before every step (a leaked generator "
                           "state then predicts at most one step); a resume is then no longer bit-exact.")
    verify: bool = doc(True, "Before training, check the engine's per-example norms and clipped sums against "
                       "brute-force autograd on synthetic token ids (no private data, no privacy cost); any "
                       "mismatch stops the run naming the layer. Does not change privacy.")


@dataclass
class TrainConfig:
    optimizer: Literal["adam", "adamw", "sgd"] = doc("adam", "Optimizer wrapped by the DP optimizer (DP-Adam by default).")
    learning_rate: float = doc(5e-4, "Learning rate.", gt=0)
    weight_decay: float = doc(0.0, "Weight decay (Li et al. use none).", ge=0)
    epochs: float = doc(10.0, "Training epochs (steps = epochs / sampling rate).", gt=0)
    max_steps: Optional[int] = doc(None, "Stop after this many optimizer steps (overrides epochs for the step count).", ge=1)
    batch_size: int = doc(1024, "Expected logical batch size B (sampling rate q = B/n).", ge=1)
    physical_batch_size: Optional[int] = doc(None, "Micro-batch size per forward pass; empty picks one that fits "
                                             "memory. Does not change privacy.", ge=1)
    seed: int = doc(0, "Seed of the public random choices: initialisation, dropout (and the sampler and noise only "
                    "with privacy.reproducible_noise=true, or for a non-private run).", ge=0)
    device: str = doc("auto", "auto, cpu, cuda or cuda:N.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = doc(
        "auto", "auto = bf16 autocast on GPU, fp32 on CPU. Norms accumulate in fp32 either way.")
    eval_every: Optional[int] = doc(None, "Evaluate every N steps (empty: only at the end).", ge=1)
    checkpoint_every: Optional[int] = doc(None, "Checkpoint every N steps (empty: only at the end).", ge=1)
    early_stopping_patience: Optional[int] = doc(
        None, "Stop after this many periodic validation evaluations (train.eval_every) without a better primary "
        "metric; empty: train every planned step. Selects on validation only, never on test; a private run "
        "stopped early reports the smaller ε of the steps it took.", ge=1)
    keep_best: bool = doc(False, "Before the final evaluation, restore the weights of the best periodic "
                          "validation evaluation (kept in best.pt; needs train.eval_every; a checkpoint follows "
                          "every evaluation).")
    log_every: int = doc(10, "Write metrics every N steps.", ge=1)


@dataclass
class EvalConfig:
    split: Literal["validation", "test"] = doc(
        "test", "Split of the final evaluation (periodic evaluations use validation). GLUE test has no labels.")
    before_training: bool = doc(False, "Also evaluate the model before the first step, as a baseline.")
    beam_size: int = doc(5, "Beam size for generation tasks.", ge=1)
    max_new_tokens: int = doc(64, "Maximum generated tokens per example.", ge=1)
    batch_size: int = doc(32, "Evaluation batch size.", ge=1)


@dataclass
class AuditConfig:
    """Bookkeeping for `dptext mia` (SPEC §7). Everything here is drawn before training, seeded, and written to
    the run's ``audit/`` folder; held-out records shrink the training set n, and q, δ = 1/(2n) follow the n
    actually trained on."""

    holdout_fraction: float = doc(0.0, "Fraction of the training split held out, untrained, as the non-member set "
                                  "of membership inference (same distribution as the members).", ge=0, lt=1)
    holdout_examples: Optional[int] = doc(None, "Hold out exactly this many non-members (overrides holdout_fraction).", ge=1)
    public_examples: int = doc(0, "Also set aside this many training records, trained on by neither the run nor "
                               "its non-members: the 'public' pool shadow and reference models train on.", ge=0)
    seed: int = doc(0, "Seed of the member / non-member / public partition and of the canaries.", ge=0)
    train_indices: list = doc([], "Train only on these indices of the training split (written by `dptext mia` "
                              "for its shadow/reference models; empty = all).")
    canaries: int = doc(0, "Canaries per repetition count inserted into the training data (language-model tasks).", ge=0)
    canary_repetitions: list = doc([1, 10], "How many times each canary is repeated, one group of `canaries` "
                                   "canaries per entry.")
    canary_prefix: str = doc("the secret code is", "Fixed prefix of every canary; the secret follows it.")
    canary_words: int = doc(4, "Random words in each canary's secret.", ge=1)
    canary_vocabulary: int = doc(100, "Size of the word list secrets are drawn from: |R| = vocabulary ** words.", ge=2)


@dataclass
class DistillConfig:
    """`dptext distill` (DistilDP, SPEC §6): a student learns from a DP teacher's synthetic data and soft labels.

    The recipe's ``data`` section names the private data (the baselines train on it; every method reports the
    student's perplexity on its ``eval.split``), ``train`` the student's optimisation, and ``privacy`` the
    budget of the DP baselines (dp_sgd: all of it; dpkd: what the teacher left, by basic composition)."""

    method: Literal["distildp", "synthetic_only", "dp_sgd", "dpkd", "zero_shot"] = doc(
        "distildp", "distildp: non-private KD on the teacher's synthetic data (ε inherited); synthetic_only: the "
        "same with kd_lambda=0; dp_sgd: DP-SGD on the student alone on the private data; dpkd: DP-SGD on the KD "
        "objective on the private data with a teacher trained on part of the budget; zero_shot: no training.")
    teacher: Optional[str] = doc(None, "Finished `dptext finetune` run directory of the DP teacher (for dpkd: the "
                                 "teacher trained with its share of the budget).")
    synthetic: Optional[str] = doc(None, "Folder written by `dptext synth` from this teacher (distildp, "
                                   "synthetic_only).")
    max_synthetic_examples: Optional[int] = doc(None, "Train on only the first N synthetic training records.", ge=1)
    student: Optional[str] = doc(None, "Student model: hub name (distilgpt2), local folder or offline alias; empty "
                                 "means the teacher's base model (recipe model.name of the teacher run).")
    student_layers: list = doc([], "Keep only these decoder layers of the student model (0-based), e.g. [2, 5, 8]; "
                               "embeddings, final norm and head are kept (tied weights stay tied).")
    student_layer_stride: Optional[int] = doc(None, "Keep every N-th decoder layer counted from the top (the last "
                                              "layer is kept); e.g. 3 turns SmolLM2-135M's 30 layers into 10.", ge=1)
    kd_lambda: float = doc(0.4, "λ: weight of the distillation term, L = (1−λ)·CE + λ·t²·KL(teacher‖student).", ge=0, le=1)
    temperature: float = doc(1.0, "t: softmax temperature of the distillation term.", gt=0)
    hidden_alpha: float = doc(0.0, "α: weight of the MSE between last hidden states (teacher and student hidden "
                              "sizes must match).", ge=0)


@dataclass
class Recipe:
    name: str = doc("recipe", "Run name; the run directory is runs/<name>-<timestamp>/.")
    description: str = doc("", "One line saying what this recipe reproduces or does.")
    model: ModelConfig = section(ModelConfig, "The model.")
    data: DataConfig = section(DataConfig, "The dataset.")
    task: TaskConfig = section(TaskConfig, "The objective.")
    privacy: PrivacyConfig = section(PrivacyConfig, "Differential privacy settings.")
    train: TrainConfig = section(TrainConfig, "Optimisation.")
    eval: EvalConfig = section(EvalConfig, "Evaluation.")
    distill: DistillConfig = section(DistillConfig, "`dptext distill`: teacher, synthetic data, student, λ, t, α.")
    audit: AuditConfig = section(AuditConfig, "Privacy-auditing bookkeeping: non-members, public pool, canaries.")


# --------------------------------------------------------------------------- typing helpers

def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or empty" if optional else name


def all_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema, e.g. 'privacy.target_epsilon'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], key + "."))
    return keys


def schema_docs(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field: the documented schema."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(schema_docs(tp, prefix + f.name + "."))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        allowed = bounds_text(f.metadata)
        type_text = _type_name(tp) + (f", {allowed}" if allowed else "")
        rows.append((prefix + f.name, type_text, default, f.metadata.get("doc", "")))
    return rows


def _unknown_key_error(key: str, cls: type, prefix: str) -> UserError:
    valid = all_keys(Recipe)
    full = prefix + key
    close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under the right section, e.g. 'privacy.epsilon'
        leaves = [k for k in valid if k.rsplit(".", 1)[-1] == key or key in k]
        close = leaves[:1]
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys are listed by `dptext check --schema`."
    return UserError(f"Unknown recipe key '{full}'{hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None or (value == "" and inner is not str):
        if optional:
            return None
        raise UserError(f"Recipe key '{key}' cannot be empty; give a {_type_name(tp)}.")
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"Recipe key '{key}' is '{value}' but must be {_type_name(inner)}{hint}.")
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false", "yes", "no"}:
            return value.lower() in {"true", "yes"}
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-5' as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif inner is list or typing.get_origin(inner) is list:
        if isinstance(value, list):
            return value
    elif inner is dict or typing.get_origin(inner) is dict:
        if isinstance(value, dict):
            return value
    else:  # pragma: no cover - a schema field of a type this loader does not know
        raise TypeError(f"unsupported schema type {tp!r} for {key}")
    raise UserError(f"Recipe key '{key}' is {value!r} but must be {_type_name(tp)}.")


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build a schema dataclass from plain data, strictly."""
    if not isinstance(data, dict):
        raise UserError(f"Recipe section '{prefix.rstrip('.') or 'top level'}' must be a mapping of keys to values.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(str(key), cls, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, prefix + key + ".")
            continue
        kwargs[key] = _coerce(value, tp, prefix + key)
        if kwargs[key] == "" and fields[key].default not in ("", None):  # a name, a path: empty means nothing
            raise UserError(f"Recipe key '{prefix + key}' cannot be empty; give a {_type_name(tp)} "
                            f"(default: {fields[key].default}).")
        check_value(prefix + key, kwargs[key], fields[key].metadata)
    return cls(**kwargs)


def given_keys(data: Any, prefix: str = "") -> set[str]:
    """The dotted keys a recipe's raw data sets (sections recursed), e.g. {'privacy.target_epsilon'}."""
    keys: set[str] = set()
    for key, value in (data or {}).items() if isinstance(data, dict) else []:
        keys.add(prefix + str(key))
        if isinstance(value, dict):
            keys |= given_keys(value, prefix + str(key) + ".")
    return keys


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'privacy.target_epsilon=3' -> (['privacy', 'target_epsilon'], 3), values read as YAML."""
    import yaml

    if "=" not in text:
        raise UserError(f"Override '{text}' is not of the form key=value, e.g. privacy.target_epsilon=3.")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"Override '{text}' has no key; write it as key=value, e.g. train.epochs=1.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"Override '{text}' descends into '{part}', which is a value, not a section.")
            node = child
        node[path[-1]] = value
    return data


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or start from the defaults when path is None), apply overrides, validate."""
    import yaml

    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"Recipe file '{path}' does not exist; check the path (shipped recipes are in recipes/).")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"Recipe '{path}' is not valid YAML{where}; fix the syntax and retry.") from exc
        if not isinstance(data, dict):
            raise UserError(f"Recipe '{path}' must be a YAML mapping of sections (model:, data:, ...).")
        data.setdefault("name", path.stem)
    data = apply_overrides(data, overrides or [])
    recipe = from_dict(Recipe, data)
    check_relations(recipe, given_keys(data))
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    import yaml

    return yaml.safe_dump(to_dict(recipe), sort_keys=False, allow_unicode=True)
