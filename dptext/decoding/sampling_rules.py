"""Which decoding settings keep the DP guarantee, and which are refused (no torch needed).

Theorem 1 of Majmudar et al. covers *random sampling* from q'. Settings that act on q before
the mixing are harmless (any q gives the same bound); settings that act on q' after it, or
replace sampling by a deterministic choice, are not.
"""

from __future__ import annotations

from dptext.errors import UserError

# Plain multinomial sampling with nothing after a custom processor: every warper generate()
# appends after custom processors switched off, and every mode other than sampling (beam,
# constrained, contrastive, assisted/prompt-lookup, DoLa) off. Passed explicitly because unset
# values are filled from the model's generation_config (which may set any of them) and then
# from global defaults (top_k=50).
PLAIN_SAMPLING_SETTINGS = {
    "do_sample": True,
    "num_beams": 1,
    "num_return_sequences": 1,  # one sample per query: a model's config could ask for several (each costs ε)
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "num_beam_groups": None,
    "constraints": None,
    "force_words_ids": None,
    "penalty_alpha": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "use_mtp": False,
    "dola_layers": None,
}


# generate() arguments that act before the DP processor (on q, which the guarantee allows)
# or not on the distribution at all. Anything else could reorder or replace the sampling.
# Custom stopping criteria are left out on purpose: they see the scores, so *when* the
# output stops could reveal q' beyond the sampled tokens.
SAFE_GENERATE_ARGS = {"pad_token_id", "eos_token_id", "bos_token_id", "min_new_tokens", "repetition_penalty",
                      "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "logits_processor", "use_cache"}

# Sampling warpers that would run after the DP processor, and the values that switch them off.
NEUTRAL_WARPER_VALUES = {"top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0), "typical_p": (None, 1.0),
                         "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,)}

SAMPLING_ONLY = ("the DP guarantee (Majmudar et al., Theorem 1) covers random sampling from q' only: greedy and "
                 "beam search pick the most likely tokens deterministically, which can reveal the private model's "
                 "ranking, so they are refused")


def refuse_unsafe_decoding(settings: dict) -> None:
    """UserError for any decoding setting that would break the guarantee, saying why."""
    if settings.get("do_sample") is False:
        raise UserError(f"Greedy decoding was requested, but {SAMPLING_ONLY}; drop it to sample from q'.")
    if (settings.get("num_beams") or 1) > 1 or (settings.get("num_beam_groups") or 1) > 1:
        raise UserError(f"Beam search was requested, but {SAMPLING_ONLY}; use num_beams=1.")
    for key, neutral in NEUTRAL_WARPER_VALUES.items():
        if key in settings and settings[key] not in neutral:
            raise UserError(f"{key}={settings[key]} was requested, but truncating the support with the private "
                            "model's own probabilities voids the guarantee; sample from the full vocabulary or "
                            "take the support from a public model (--public-model P --top-k K).")
    unknown = sorted(set(settings) - SAFE_GENERATE_ARGS - set(NEUTRAL_WARPER_VALUES)
                     - {"do_sample", "num_beams", "num_beam_groups", "temperature"})
    if unknown:
        raise UserError(f"The generate setting(s) {', '.join(unknown)} may change how tokens are drawn from q', "
                        f"so DP generation refuses them; allowed: {', '.join(sorted(SAFE_GENERATE_ARGS))}.")
