"""`dptext decode`: differentially private decoding (λ-perturbed sampling), one query or a perplexity sweep."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from dptext.cli.common import JsonOption, make_output

HELP = """Sample from a trained model with a per-query DP guarantee (Majmudar et al.), or measure the privacy/utility \
trade-off on held-out text.

Each next-token (or masked-token) distribution q is mixed with the uniform one, q' = λq + (1−λ)u, and tokens are \
drawn at random from q' (random sampling only: greedy, beam search, top-k and top-p are refused). One query of at most \
T sampled tokens is ε-DP with ε = T·log((1 + (|V|−1)λ)/(1−λ)), |V| = the model's output dimension.

Examples:

  dptext decode --model smollm2-135m --lambda 0.8 --prompt "The food was" --max-new-tokens 20

  dptext decode --model smollm2-135m --data held_out.txt --sweep 0.1:1.0:0.1 --plot sweep.png
"""


def decode(
    model: Annotated[str, typer.Option("--model", "-m", help="Model: hub name, local folder or offline alias "
                                       "(smollm2-135m, tiny-gpt2, tiny-roberta, ...).")],
    prompt: Annotated[Optional[List[str]], typer.Option("--prompt", "-p", help="Prompt to continue (causal LM) or text "
                                                        "with mask tokens to fill (masked LM); repeat for a batch. "
                                                        "Each prompt is one query.")] = None,
    lam: Annotated[Optional[float], typer.Option("--lambda", help="Weight λ ∈ [0, 1) of the model in q' = λq + "
                                                 "(1−λ)u; smaller is more private.")] = None,
    eps: Annotated[Optional[float], typer.Option("--eps", help="Target ε per query instead of --lambda: λ is solved "
                                                 "for T and |V|.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-T", help="Tokens to generate: the T that ε is "
                                                "computed for (causal LMs).")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="Temperature applied to q before the mixing; does "
                                               "not change ε.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed, for reproducible outputs (the guarantee "
                                                "assumes readers do not know it).")] = None,
    public_model: Annotated[Optional[str], typer.Option("--public-model", help="A PUBLIC model with the same tokenizer "
                                                        "whose top-k tokens form the support; ε then uses k instead "
                                                        "of |V|.")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Support size k taken from --public-model (never from "
                                                 "the private model).")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Refused: nucleus sampling on the private model "
                                                   "voids the guarantee.", hidden=True)] = None,
    greedy: Annotated[bool, typer.Option("--greedy", help="Refused: the guarantee covers "
                                         "random sampling only.", hidden=True)] = False,
    num_beams: Annotated[int, typer.Option("--num-beams", help="Refused above 1: the guarantee covers "
                                           "random sampling only.", hidden=True)] = 1,
    data: Annotated[Optional[Path], typer.Option("--data", help="Held-out text for a sweep: one example per line, or "
                                                 ".jsonl with a text field.")] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="λ values for --data: start:stop:step (stop "
                                                 "included) or a comma list. Default 0.1:1.0:0.1.")] = None,
    text_column: Annotated[str, typer.Option("--text-column", help="Field holding the text in a "
                                             ".jsonl --data file.")] = "text",
    max_examples: Annotated[Optional[int], typer.Option("--max-examples", help="Use only the first N "
                                                        "examples of --data.")] = None,
    max_length: Annotated[int, typer.Option("--max-length", help="Truncate each example to this many tokens.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Examples per forward pass (does not change privacy "
                                            "or results).")] = 16,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of perplexity "
                                                 "against ε (sweep only).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto (GPU if present), cpu or cuda.")] = "auto",
    json_mode: JsonOption = False,
) -> None:
    out = make_output(json_mode)
    refuse_bad_options(prompt=prompt, lam=lam, eps=eps, public_model=public_model, top_k=top_k, top_p=top_p,
                       greedy=greedy, model=model, num_beams=num_beams, data=data, sweep=sweep, plot=plot,
                       max_examples=max_examples, max_length=max_length, batch_size=batch_size)
    from dptext.model_check import check_model_name

    check_model_name(model, key="--model")
    if public_model is not None:
        check_model_name(public_model, key="--public-model")
    if data is not None:
        run_sweep(out, model=model, data=data, sweep=sweep, lam=lam, text_column=text_column,
                  max_examples=max_examples, max_length=max_length, batch_size=batch_size, plot=plot, seed=seed,
                  device=device)
    else:
        run_generation(out, model=model, prompts=prompt or [], lam=lam, eps=eps, max_new_tokens=max_new_tokens,
                       temperature=temperature, seed=seed, public_model=public_model, top_k=top_k, device=device)


def _same_model(first: str, second: str) -> bool:
    import os

    def norm(name: str) -> str:
        path = os.path.expanduser(name)
        return os.path.realpath(path) if os.path.exists(path) else name.rstrip("/")

    return norm(first) == norm(second)


def refuse_bad_options(prompt, lam, eps, public_model, top_k, top_p, greedy, num_beams, data, sweep, plot,
                       max_examples, max_length, batch_size, model: str | None = None) -> None:
    """Every mistake that needs no model, caught before the (slow) model load."""
    from dptext.decoding import check_lambda, refuse_unsafe_decoding
    from dptext.errors import UserError

    refuse_unsafe_decoding({"do_sample": not greedy, "num_beams": num_beams,
                            **({"top_p": top_p} if top_p is not None else {}),
                            **({"top_k": top_k} if top_k is not None and public_model is None else {})})
    if public_model is not None and top_k is None:
        raise UserError("--public-model needs --top-k K: the number of the public model's top tokens to sample from.")
    if public_model is not None and model is not None and _same_model(public_model, model):
        raise UserError("--public-model names the private model itself, so its top-k would be chosen with the "
                        "private model and ε with |V| = k would not hold; give a separate public model "
                        "(e.g. the pre-trained base) or drop --public-model.")
    if lam is not None and eps is not None:
        raise UserError("Give either --lambda or --eps, not both.")
    if lam is not None:
        check_lambda(lam, allow_one=data is not None)  # λ = 1 is the non-private baseline row of a sweep
    if eps is not None and not eps > 0:
        raise UserError(f"--eps must be > 0, got {eps}; ε = 0 would mean λ = 0, a uniformly random output.")
    if data is None:
        if not prompt:
            raise UserError("Give --prompt TEXT to decode, or --data FILE --sweep 0.1:1.0:0.1 for a perplexity sweep.")
        if not all(p.strip() for p in prompt):  # nothing to continue: the model would get no token at all
            raise UserError("--prompt is empty; give the text to continue (e.g. --prompt 'The food was').")
        if lam is None and eps is None:
            raise UserError("Choose the privacy level with --lambda (e.g. 0.8) or --eps (e.g. 50).")
        if sweep is not None or plot is not None:
            raise UserError("--sweep and --plot need --data FILE with held-out text.")
        return
    if prompt:
        raise UserError("Give either --prompt (decode) or --data (perplexity sweep), not both.")
    if eps is not None:
        raise UserError("A sweep takes λ values (--sweep); ε per example is reported for each of them.")
    if lam is not None and sweep is not None:
        raise UserError("Give either --lambda or --sweep with --data, not both.")
    if public_model is not None:
        raise UserError("--public-model is for generation: a perplexity sweep over a public top-k support would be "
                        "infinite whenever a reference token falls outside it.")
    if not data.is_file():
        raise UserError(f"Data file '{data}' does not exist; pass a text file (one example per line) or a .jsonl file.")
    for name, value in (("--max-examples", max_examples), ("--max-length", max_length), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, got {value}.")


def run_generation(out, model, prompts, lam, eps, max_new_tokens, temperature, seed, public_model, top_k,
                   device) -> None:
    from dptext.decoding import PublicSupport, dp_fill_masks, dp_generate, lambda_for_epsilon, output_vocab_size
    from dptext.decoding.loading import MASKED, load_for_decoding
    from dptext.errors import UserError

    private, tokenizer, kind = load_for_decoding(model, device)
    public = None
    if public_model is not None:
        if kind == MASKED:
            raise UserError("--public-model is supported for causal LMs (generation) only.")
        public_net, public_tokenizer, _ = load_for_decoding(public_model, str(next(private.parameters()).device))
        public = PublicSupport(public_net, public_tokenizer, top_k)
    support = top_k if public is not None else output_vocab_size(private)
    if kind == MASKED:
        mask_counts = [tokenizer(p)["input_ids"].count(tokenizer.mask_token_id) for p in prompts]
        tokens = max(mask_counts) or 1
    else:
        tokens = max_new_tokens
    if eps is not None:
        lam = lambda_for_epsilon(eps, support, tokens)
        out.info(f"λ = {lam:.6g} spends at most ε = {eps:g} per query (T = {tokens}, |V| = {support}).")
    if seed is not None:
        out.info("note: --seed makes the output reproducible; the guarantee assumes its reader does not know the seed.")
    if kind == MASKED:
        result = dp_fill_masks(private, tokenizer, prompts, lam, temperature=temperature, seed=seed)
    else:
        result = dp_generate(private, tokenizer, prompts, lam, max_new_tokens, temperature=temperature, seed=seed,
                             public=public)
    support_text = f"top-{top_k} of public model {public_model}" if public else "full vocabulary"
    rows = [(p, text, t, e) for p, text, t, e in zip(prompts, result.texts, result.tokens, result.epsilons)]
    out.table(f"DP decoding with {model}: λ = {result.lam:.6g}, |V| = {result.support_size} ({support_text})",
              ["prompt", "output", "T", "ε"], rows)
    out.result({"mode": "generate" if kind != MASKED else "fill_masks", "model": model, "kind": kind,
                "lambda": result.lam, "support_size": result.support_size, "support": support_text,
                "temperature": temperature, "seeded": seed is not None,  # never the seed: with it, the outputs
                # are a known function of the private model's distributions (the JSON is what gets shared)
                "outputs": [{"prompt": p, "text": text, "tokens": t, "epsilon": e} for p, text, t, e in rows]})


def run_sweep(out, model, data, sweep, lam, text_column, max_examples, max_length, batch_size, plot, seed,
              device) -> None:
    from dptext.decoding import parse_lambdas, perplexity_sweep, plot_sweep, read_texts
    from dptext.decoding.loading import load_for_decoding
    from dptext.decoding.sweep import PAPER_GRID, planned_batches

    lambdas = [lam] if lam is not None else parse_lambdas(sweep or PAPER_GRID)
    texts = read_texts(data, text_column, max_examples)
    private, tokenizer, kind = load_for_decoding(model, device)
    with out.progress(planned_batches(len(texts), batch_size, kind), f"scoring {len(texts)} examples") as bar:
        result = perplexity_sweep(private, tokenizer, kind, texts, lambdas, max_length=max_length,
                                  batch_size=batch_size, seed=seed or 0, on_batch=bar.advance)
    rows = [(r.lam, r.epsilon, r.epsilon_per_token, r.perplexity, f"{100 * r.relative_increase:+.1f}%")
            for r in result.rows]
    out.table(f"{model} on {data.name}: {result.examples} examples, T = {result.tokens_per_example:.2f} "
              f"{'predicted' if kind == 'causal_lm' else 'masked'} tokens per example, |V| = {result.vocab_size}",
              ["λ", "ε per example", "ε per token", "perplexity", "vs λ=1"], rows)
    if plot is not None:
        plot_sweep(result, plot, title=f"{model} on {data.name} ({result.examples} examples)")
        out.info(f"plot written to {plot}")
    out.result({"mode": "sweep", "model": model, "data": str(data), **result.to_dict(),
                "plot": str(plot) if plot else None})


def register(app: typer.Typer) -> None:
    app.command("decode", help=HELP)(decode)
