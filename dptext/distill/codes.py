"""The control-code distribution synthetic data is conditioned on (DistilDP, SPEC §6 step 3).

Codes are categorical attributes of the private records ("Category: books || Rating: 4").
The paper samples them from the *exact* private distribution, which is not DP (the frequencies
are a function of the data). ``code_distribution`` draws them from a DP histogram by default:

* ``laplace``   — counts + Laplace(1/ε_h) noise per cell: ε_h-DP (add/remove one record changes one
  cell by 1, so the L1 sensitivity is 1). The default of ``dptext synth``.
* ``gaussian``  — counts + N(0, σ_h²) per cell with σ_h calibrated so that the Gaussian mechanism
  (L2 sensitivity 1, exactly (1/σ_h)-GDP) is (ε_h, δ_h)-DP (analytic Gaussian mechanism,
  Balle & Wang 2018; the δ(ε) of a μ-GDP mechanism is in ``dptext.accounting.gdp``).
* ``exact``     — the paper's empirical frequencies; only on explicit request, and the output is
  then marked not covered by ε (``release.json``, provenance).

The histogram's cells are the declared code domain (``task.code_domain`` of the teacher's recipe,
or ``--code-domain``): every possible code, fixed from public documentation without looking at
the data, so the noise protects which codes occur as well as how often. A DP histogram without a
declared domain is refused (its cells would publish the codes present), and so is a training
record whose code lies outside the domain (by its position, never its value). Noisy counts are
clipped at 0 and normalised; (ε_h, δ_h) is added to the teacher's by basic composition. The noise is drawn
from secret OS entropy, never from `dptext synth --seed` (which is written to plan.json and only drives what is
post-processing of the noisy histogram: code sampling, the split, generation).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.optimize import brentq

from dptext.accounting.events import LARGE_DELTA
from dptext.accounting.gdp import gdp_delta
from dptext.errors import UserError
from dptext.tasks.label_sets import canonical, check_code_domain

MECHANISMS = ("laplace", "gaussian", "exact")
DEFAULT_CODE_EPSILON = 1.0  # Laplace histogram's ε when none is given: 16 cells of ~30 records keep their shape


@dataclass
class CodeDistribution:
    """Codes (tuples of field values), their sampling probabilities, and what it cost in privacy.

    ``noisy_counts`` are the DP histogram's counts (empty for ``exact``, whose exact private counts are never
    stored); for ``exact`` the probabilities are the exact private frequencies and are saved under a key
    that says so."""

    fields: list[str]
    codes: list[tuple]
    probabilities: list[float]
    mechanism: str
    epsilon: float = 0.0
    delta: float = 0.0
    noise_scale: float | None = None
    noisy_counts: list[float] = field(default_factory=list)

    @property
    def probability_key(self) -> str:
        return "exact_private_frequencies" if self.mechanism == "exact" else "probabilities_from_noisy_counts"

    def to_dict(self) -> dict[str, Any]:
        data = {"fields": self.fields, "mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta,
                "noise_scale": self.noise_scale, "codes": [list(c) for c in self.codes],
                self.probability_key: self.probabilities}
        if self.mechanism != "exact":
            data["noisy_counts"] = self.noisy_counts
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CodeDistribution":
        probabilities = next(data[k] for k in ("probabilities_from_noisy_counts", "exact_private_frequencies",
                                               "probabilities") if k in data)
        return cls(fields=list(data["fields"]), codes=[tuple(c) for c in data["codes"]],
                   probabilities=list(probabilities), mechanism=data["mechanism"],
                   epsilon=data["epsilon"], delta=data["delta"], noise_scale=data["noise_scale"],
                   noisy_counts=list(data.get("noisy_counts", [])))


def gaussian_sigma(epsilon: float, delta: float) -> float:
    """σ of the Gaussian mechanism with sensitivity 1 that is exactly (ε, δ)-DP (μ = 1/σ GDP)."""
    if not (0 < epsilon < math.inf and 0 < delta < 1):
        raise UserError(f"The Gaussian code histogram needs a finite --code-epsilon > 0 and 0 < δ < 1 (got "
                        f"ε={epsilon}, δ={delta}); pass --code-epsilon and --code-delta.")
    if delta >= LARGE_DELTA:  # as privacy.delta: the histogram may publish the exact counts with probability δ
        raise UserError(f"--code-delta {delta:g} makes the histogram's ε meaningless (δ is the chance of an "
                        f"outright leak; δ ≥ {LARGE_DELTA:g} is refused); use a δ below 1/n, e.g. 1e-6, or the "
                        "Laplace histogram (δ = 0).")
    # δ(ε; μ) increases with μ: find μ with δ(ε; μ) = δ, then σ = 1/μ.
    high = 1.0
    while gdp_delta(epsilon, high) < delta:
        high *= 2
    mu = brentq(lambda m: gdp_delta(epsilon, m) - delta, 1e-9, high, xtol=1e-14, rtol=1e-12)
    return 1.0 / mu


def code_of(record: dict[str, Any], fields: Sequence[str]) -> tuple:
    missing = [f for f in fields if f not in record]
    if missing:
        raise UserError(f"Control-code fields {missing} are not in the data (fields: {sorted(record)}); "
                        "fix task.control_codes in the teacher's recipe.")
    return tuple(record[f] for f in fields)


def code_distribution(records: Sequence[dict[str, Any]], fields: Sequence[str], mechanism: str = "laplace", *,
                      epsilon: float | None = None, delta: float | None = None,
                      domain: dict[str, list] | None = None, seed: int | None = None) -> CodeDistribution:
    """The distribution codes are sampled from, by ``mechanism`` (see the module docstring).

    The histogram noise comes from fresh operating-system entropy, never from a public seed: whoever knew the
    seed could regenerate the noise and subtract it from the published noisy counts (the exact private counts
    would follow). ``seed`` pins it for tests only."""
    if mechanism not in MECHANISMS:
        raise UserError(f"Code distribution '{mechanism}' is unknown; choose one of {', '.join(MECHANISMS)}.")
    if not fields:
        raise UserError("The teacher was trained without control codes (task.control_codes is empty); "
                        "DistilDP needs a teacher fine-tuned with codes.")
    counts = Counter(code_of(r, fields) for r in records)
    if mechanism == "exact":
        codes = sorted(counts, key=str)
        total = sum(counts.values())
        return CodeDistribution(list(fields), codes, [counts[c] / total for c in codes], "exact")
    if not domain:
        raise UserError("A DP code histogram needs the declared code domain: set task.code_domain in the teacher's "
                        "recipe or pass --code-domain 'field=v1,v2;...' (or --codes exact, "
                        "which is not covered by ε).")
    check_code_domain(records, fields, domain)
    codes = list(itertools.product(*(domain[f] for f in fields)))
    exact = np.array([sum(n for code, n in counts.items() if list(map(canonical, code)) == list(map(canonical, cell)))
                      for cell in codes], dtype=float)
    rng = np.random.default_rng(seed)
    if mechanism == "laplace":
        epsilon = DEFAULT_CODE_EPSILON if epsilon is None else epsilon
        if not 0 < epsilon < math.inf:  # inf: noise of scale 0, the exact counts published as 'noisy_counts'
            raise UserError(f"The Laplace code histogram needs a finite --code-epsilon > 0 (got {epsilon}).")
        scale, eps, dlt = 1.0 / epsilon, float(epsilon), 0.0
        noisy = exact + rng.laplace(0.0, scale, size=len(codes))
    else:
        scale = gaussian_sigma(float(epsilon or 0), float(delta or 0))
        eps, dlt = float(epsilon), float(delta)
        noisy = exact + rng.normal(0.0, scale, size=len(codes))
    clipped = np.clip(noisy, 0.0, None)
    if clipped.sum() <= 0:
        raise UserError("Every noisy code count is 0 (too much noise for this little data); raise --code-epsilon.")
    probabilities = (clipped / clipped.sum()).tolist()
    return CodeDistribution(list(fields), codes, probabilities, mechanism, eps, dlt, scale, noisy_counts=noisy.tolist())


def sample_codes(distribution: CodeDistribution, n: int, seed: int) -> list[tuple]:
    """``n`` codes drawn i.i.d. from the distribution (a fixed, seeded stream)."""
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(distribution.codes), size=n, p=np.asarray(distribution.probabilities))
    return [distribution.codes[i] for i in picks]


def total_variation(sampled: Sequence[tuple], distribution: CodeDistribution) -> float:
    """TV distance between the empirical frequencies of ``sampled`` and the distribution."""
    counts = Counter(sampled)
    n = max(len(sampled), 1)
    keys = set(counts) | set(distribution.codes)
    target = dict(zip(distribution.codes, distribution.probabilities))
    return 0.5 * sum(abs(counts.get(k, 0) / n - target.get(k, 0.0)) for k in keys)


def compose_basic(teacher_epsilon: float, teacher_delta: float, codes: CodeDistribution) -> dict[str, float]:
    """Basic (sequential) composition of the teacher and the code histogram: ε and δ add."""
    return {"epsilon": teacher_epsilon + codes.epsilon, "delta": teacher_delta + codes.delta}


def parse_domain(text: str | None) -> dict[str, list] | None:
    """'category=books,dvd;rating=1,2,4,5' -> {'category': ['books', 'dvd'], 'rating': [1, 2, 4, 5]}."""
    if not text:
        return None
    domain = {}
    for part in text.split(";"):
        if "=" not in part:
            raise UserError(f"Code domain part '{part}' is not field=v1,v2; e.g. 'category=books,dvd;rating=1,2'.")
        name, values = part.split("=", 1)
        domain[name.strip()] = [int(v) if v.strip().lstrip("-").isdigit() else v.strip()
                                for v in values.split(",") if v.strip()]
    return domain


__all__ = ["CodeDistribution", "MECHANISMS", "DEFAULT_CODE_EPSILON", "code_distribution", "sample_codes",
           "gaussian_sigma", "total_variation", "compose_basic", "parse_domain"]


def check_composed_delta(info: dict[str, Any], code_settings: dict[str, Any]) -> None:
    """Refuse a synthetic-data δ (teacher's + histogram's) of 0.1 or more, as finetune refuses privacy.delta: each
    part may pass alone while the sum that the output claims does not (allowed where the teacher's recipe allowed
    a large δ, privacy.allow_large_delta)."""
    teacher = info["privacy"]
    if not teacher["private"]:
        return
    code_delta = float(code_settings["delta"] or 0.0) if code_settings["mechanism"] == "gaussian" else 0.0
    total = float(teacher["delta"]) + code_delta
    if total >= LARGE_DELTA and not info["recipe"].privacy.allow_large_delta:
        raise UserError(f"The synthetic data would claim δ = {total:.3g} (teacher {teacher['delta']:.3g} + code "
                        f"histogram {code_delta:.3g}), and at δ ≥ {LARGE_DELTA:g} no ε means much (δ is the chance "
                        "of an outright leak); lower --code-delta or use a teacher trained with a smaller δ.")
