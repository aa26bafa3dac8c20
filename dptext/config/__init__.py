"""Recipe schema, YAML loading and dotted overrides.

A recipe is pure data: a YAML file whose sections map onto the section dataclasses of this
package (one module per section). Every field has its default and its documentation in its
section module, in one place (``doc`` metadata), and nowhere else: engine code reads
``recipe.privacy.max_grad_norm``, never ``cfg.get("max_grad_norm", 0.1)``.

Loading is strict: unknown keys are errors that name the nearest valid key, values are
checked against the field types (``Literal`` choices, numbers, optional fields), and
command-line overrides such as ``privacy.target_epsilon=3`` go through the same checks.

Settings that change the privacy guarantee (σ, C, q, steps, δ) live in ``privacy`` and
``train.batch_size``/``train.epochs``; settings that cannot (micro-batch size, clipping
mode, dtype) are marked as such in their docs.

Modules: ``fields`` (the ``doc``/``section`` field builders), one module per section (``model``, ``data``,
``task``, ``privacy``, ``train`` (train and eval), ``audit``, ``distill``), ``recipe`` (the whole recipe),
``schema`` (keys and documented rows), ``overrides`` (``key=value`` parsing) and ``loader`` (strict loading).
"""

from dptext.config.audit import AuditConfig
from dptext.config.data import DataConfig
from dptext.config.distill import DistillConfig
from dptext.config.fields import doc, section
from dptext.config.loader import dump_recipe, from_dict, given_keys, load_recipe, to_dict
from dptext.config.model import ModelConfig
from dptext.config.overrides import apply_overrides, parse_override
from dptext.config.privacy import PrivacyConfig
from dptext.config.recipe import Recipe
from dptext.config.schema import _is_optional, _type_name, all_keys, schema_docs
from dptext.config.task import TaskConfig
from dptext.config.train import EvalConfig, TrainConfig

__all__ = [
    "AuditConfig", "DataConfig", "DistillConfig", "EvalConfig", "ModelConfig", "PrivacyConfig", "Recipe",
    "TaskConfig", "TrainConfig", "all_keys", "apply_overrides", "doc", "dump_recipe", "from_dict", "given_keys",
    "load_recipe", "parse_override", "schema_docs", "section", "to_dict",
]
