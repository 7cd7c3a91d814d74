"""Step "peers": what a user could do instead of this conversion, computed on the same model, texts and windows.

At the conversion's own KV saving (the KV values a token its layers cache, against the original's), side by side:
- attention drop (ShortGPT-style block influence, no training): the attention sub-block of the k layers whose
  attention changes the residual stream least, BI = 1 - cos(h, h + attn(h)), is removed;
- layer drop (ShortGPT): the k whole layers of lowest BI = 1 - cos(layer input, layer output) are removed;
- the original with a 4-bit KV cache (transformers' QuantizedCache, quanto backend, its defaults: groups of 64 values,
  the last 128 tokens kept in full precision), where optimum-quanto is installed;
- PCA of the keys (Palu-style, no training): every layer's pre-RoPE keys projected on their top principal directions
  (hfcompress.keys, criterion `pca`, layout `pre`), one width for all layers, the widest that saves at least the
  conversion's KV values a token; a cache of the latent would hold that width instead of the keys.
Beside them, the frontier of this conversion's own KV plan: the plan it chose, made at other budgets (and its own) and
scored the same way, training-free (Method.frontier: its keys and values projected on the latents' subspaces, its
dropped attentions removed), so the card shows what the plan trades at each saving and what distillation added.
k is the fewest layers that save at least the conversion's KV values a token, and, where it saves less, one fewer.
The original runs in transformers' own classes; a removed block is a forward hook (its output zeroed, or the layer's
input passed through), and so are the projected keys, so every peer is exactly that model, nothing approximated. Block
influence and the keys' principal directions are measured on the first calibration sequences, as ShortGPT does.

A peer dominates the conversion when it saves at least as much KV cache and its perplexity is no higher on every gated
text; the pipeline says so on the console and in the card instead of presenting a dominated model as a result.
"""

import copy
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from accelerate import init_empty_weights

from ..conversion.build import assemble, converted_config
from ..conversion.methods import FrontierPoint
from ..families import family_of
from ..keys import KeySubspace, key_statistics, projected_keys, projected_values
from ..conversion.layer_plan import kv_values
from ..progress import console, progress_bar
from .validate import perplexity

INFLUENCE_SEQUENCES = 8  # calibration sequences block influence is measured on
KV_BITS = 4
KV_CHUNK = 64  # tokens per forward call of the quantized-cache perplexity: queries read the quantized keys
KV_BYTES_TOKENS = 256  # the prefill the quantized cache's bytes a token are counted after


@dataclass
class Peer:
    name: str
    kind: str  # original | conversion | attention-drop | layer-drop | kv-quantized | key-pca
    kv_ratio: float  # KV cache bytes a token, relative to the original's
    perplexity: dict[str, float]  # gated text -> perplexity
    layers: list[int] = field(default_factory=list)  # the layers it removes (attention or whole)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def head_dim(config) -> int:
    """A head's width (transformers' Qwen2 config has no head_dim: hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_values_per_token(config) -> int:
    """KV cache values a token a model of `config` keeps (a converted config: shared layers low-rank K and V, low-rank
    key or value layers their latents (and the other whole), dropped layers none; a transformers config: K and V of every layer)."""
    lisa = getattr(config, "lisa_layers", None) or {}
    key_ranks = getattr(config, "key_ranks", None) or {}
    value_ranks = getattr(config, "value_ranks", None) or {}
    dropped = set(getattr(config, "dropped_attention_layers", None) or [])
    total = 0
    for idx in range(config.num_hidden_layers):
        spec = lisa.get(str(idx), {})
        values = kv_values(config, int(spec.get("rank", 0)), int(spec.get("key_heads", config.num_attention_heads)), head_dim(config))
        if str(idx) in key_ranks or str(idx) in value_ranks:
            width = values["keep"] // 2
            total += int(key_ranks.get(str(idx), width)) + int(value_ranks.get(str(idx), width))
        else:
            total += values["drop" if idx in dropped else "share" if spec else "keep"]
    return total


def layer_output(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def block_influence(model: nn.Module, sequences: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer of transformers' `model`: (attention BI, layer BI), each the mean over tokens of 1 - cos(before,
    after) of the residual stream across the attention sub-block and across the whole layer."""
    layers = model.model.layers
    stats = {i: {"input": None, "attention": None, "output": None} for i in range(len(layers))}
    hooks = []
    for i, layer in enumerate(layers):
        def grab_input(module, args, kwargs, i=i):
            stats[i]["input"] = (args[0] if args else kwargs["hidden_states"]).float()

        def grab_attention(module, args, output, i=i):
            stats[i]["attention"] = layer_output(output).float()

        def grab_output(module, args, output, i=i):
            stats[i]["output"] = layer_output(output).float()

        hooks += [
            layer.register_forward_pre_hook(grab_input, with_kwargs=True),
            layer.self_attn.register_forward_hook(grab_attention),
            layer.register_forward_hook(grab_output),
        ]
    sums = torch.zeros(len(layers), 2, dtype=torch.float64)
    try:
        for ids in sequences[:INFLUENCE_SEQUENCES]:
            model(ids.unsqueeze(0).to(model.device), use_cache=False)
            for i, s in stats.items():
                h = s["input"]
                # Gemma 3 normalises the attention output before the residual add: measure what is added
                added = attention_added(layers[i], s["attention"])
                sums[i, 0] += (1 - nn.functional.cosine_similarity(h, h + added, dim=-1)).mean().item()
                sums[i, 1] += (1 - nn.functional.cosine_similarity(h, s["output"], dim=-1)).mean().item()
    finally:
        for hook in hooks:
            hook.remove()
    sums /= min(len(sequences), INFLUENCE_SEQUENCES)
    return sums[:, 0].tolist(), sums[:, 1].tolist()


def attention_added(layer: nn.Module, attention: torch.Tensor) -> torch.Tensor:
    """What the attention sub-block adds to the residual stream (Gemma 3 normalises its output first)."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return layer.post_attention_layernorm(attention)
    return attention


@contextmanager
def removed(model: nn.Module, attention: list[int] = (), layers: list[int] = ()) -> Iterator[None]:
    """`model` with the attention sub-block of `attention` and the whole of `layers` removed, by forward hooks."""

    def zero_attention(module, args, output):
        out = layer_output(output)
        zeros = torch.zeros_like(out)
        return (zeros, *output[1:]) if isinstance(output, tuple) else zeros

    def pass_through(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    blocks = model.model.layers
    hooks = [blocks[i].self_attn.register_forward_hook(zero_attention) for i in attention]
    hooks += [blocks[i].register_forward_hook(pass_through, with_kwargs=True) for i in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def quantized_cache_perplexity(
    model: nn.Module, ids: torch.Tensor, context: int, max_tokens: int | None, prefix: list[int], nbits: int = KV_BITS
) -> tuple[float, float]:  # fmt: skip
    """(perplexity, KV bytes a token relative to the unquantized cache) of `model` reading its keys and values back
    from transformers' quantized cache (quanto, `nbits`): the gate's windows, each fed KV_CHUNK tokens at a time so
    every query after the first chunk attends to quantized keys, as in generation (quantize.cached_logits); the bytes
    are read from the cache tensors after a prefill of KV_BYTES_TOKENS tokens, which quantizes every token (the
    long-context figure; the last 128 tokens of a generation stay in full precision on top of it)."""
    from transformers import QuantizedCache

    from ..serving.quantize import cached_logits, kv_bytes_per_token

    def new_cache():
        return QuantizedCache(backend="quanto", config=model.config, nbits=nbits)

    ids = ids[:max_tokens] if max_tokens else ids
    body = context - len(prefix)
    head = torch.tensor(list(prefix), dtype=ids.dtype)
    nll, count, first = 0.0, 0, None
    for begin in progress_bar(range(0, max(1, len(ids) - (0 if prefix else 1)), body), f"peers: {nbits}-bit KV cache"):
        window = torch.cat([head, ids[begin : begin + body]]).to(model.device)
        logits = cached_logits(model, window, new_cache, len(window), KV_CHUNK)[0]
        nll += nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
        count += len(window) - 1
        first = window if first is None else first
    plain = kv_values_per_token(model.config) * model.dtype.itemsize
    # the bytes do not depend on the tokens, only on their count, which the quantizer's groups (64 values) must divide
    prefill = first.repeat(math.ceil(KV_BYTES_TOKENS / len(first)))[:KV_BYTES_TOKENS]
    return math.exp(nll / count), kv_bytes_per_token(model, prefill, new_cache()) / plain


def fewest_layers_saving(saved: int, per_layer: int) -> list[int]:
    """The layer counts k whose removal brackets a saving of `saved` values a token: ceil, and floor where it is > 0."""
    if saved <= 0:
        return []
    ceil, floor = math.ceil(saved / per_layer), saved // per_layer
    return sorted({ceil, floor} - {0})


def pca_key_width(config, saved: int) -> int | None:
    """The key width every layer keeps in the PCA-of-keys peer: the widest that saves at least `saved` values a token
    (None where even no key at all would not)."""
    full = config.num_key_value_heads * head_dim(config)
    width = full - math.ceil(saved / config.num_hidden_layers)
    return width if saved > 0 and width > 0 else None


def pca_key_projectors(original: nn.Module, sequences: torch.Tensor, width: int) -> dict[int, torch.Tensor]:
    """Layer -> the projector on its keys' top `width` principal directions (pre-RoPE, all KV heads together)."""
    stats = key_statistics(original, sequences.to(original.device))
    dim = head_dim(original.config)
    return {
        index: KeySubspace(entry, layer.self_attn.k_proj.weight, "pca", "pre", dim).projector(width).to(original.device)
        for index, (entry, layer) in enumerate(zip(stats, original.model.layers))
    }


def kv_peer_unavailable(config) -> str | None:
    """Why the 4-bit KV cache peer cannot run on a model of `config` here (None: it can)."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return "the 4-bit KV cache peer needs optimum-quanto: pip install optimum-quanto"
    from transformers import QuantizedCache

    try:
        QuantizedCache(backend="quanto", config=config, nbits=KV_BITS)
    except ValueError as error:  # transformers' QuantizedCache takes full-attention layers only
        return f"the 4-bit KV cache peer: {str(error).rstrip('.')}"
    return None


def compute_peers(
    original: nn.Module, converted_config, sequences: torch.Tensor, evaluations: dict[str, torch.Tensor],
    context: int, max_tokens: int | None, prefix: list[int], frontier: list[FrontierPoint] = (),
) -> dict:  # fmt: skip
    """The peers at the conversion's KV saving and the `frontier` points of its plan (see the module docstring), each
    scored on every gated text; the original in transformers' classes on its device. Returns the report section."""
    config = original.config
    kept = kv_values_per_token(config)
    saved = kept - kv_values_per_token(converted_config)
    per_layer = 2 * config.num_key_value_heads * head_dim(config)
    started = time.perf_counter()
    attention_bi, layer_bi = block_influence(original, sequences)
    ranked_attention = sorted(range(1, len(attention_bi)), key=lambda i: attention_bi[i])
    ranked_layers = sorted(range(1, len(layer_bi)), key=lambda i: layer_bi[i])
    influence_seconds = time.perf_counter() - started

    def scored(label: str) -> dict[str, float]:
        return {
            text: perplexity(original, ids.to(original.device), context, max_tokens=max_tokens, label=f"peers: {label} ({text.split(' (')[0]})", prefix=prefix).perplexity
            for text, ids in evaluations.items()
        }  # fmt: skip

    peers = []
    for k in fewest_layers_saving(saved, per_layer):
        for kind, ranked in (("attention-drop", ranked_attention), ("layer-drop", ranked_layers)):
            layers = sorted(ranked[:k])
            start = time.perf_counter()
            with removed(original, **({"attention": layers} if kind == "attention-drop" else {"layers": layers})):
                values = scored(f"{kind} {k}")
            what = ("attention block" if kind == "attention-drop" else "layer") + ("s" if k > 1 else "")
            peers.append(Peer(f"drop {k} {what} (ShortGPT BI)", kind, (kept - k * per_layer) / kept, values, layers, round(time.perf_counter() - start + influence_seconds, 1)))
    key_width = pca_key_width(config, saved)
    if key_width is not None:
        start = time.perf_counter()
        with projected_keys(original, pca_key_projectors(original, sequences[:INFLUENCE_SEQUENCES], key_width)):
            values = scored(f"keys PCA {key_width}")
        full = config.num_key_value_heads * head_dim(config)
        ratio = (kept - config.num_hidden_layers * (full - key_width)) / kept
        peers.append(Peer(f"keys on {key_width} of {full} principal directions (PCA)", "key-pca", ratio, values, [], round(time.perf_counter() - start, 1)))
    skipped = kv_peer_unavailable(original.config)
    if skipped is None:
        start = time.perf_counter()
        values, ratio = {}, 1.0
        for text, ids in evaluations.items():
            values[text], ratio = quantized_cache_perplexity(original, ids, context, max_tokens, prefix)
        peers.append(Peer(f"{KV_BITS}-bit KV cache (quanto)", "kv-quantized", ratio, values, [], round(time.perf_counter() - start, 1)))
    points = []
    for point in frontier:
        start = time.perf_counter()
        with (projected_keys(original, point.key_projectors), projected_values(original, point.value_projectors),
              removed(original, attention=point.dropped_attention)):  # fmt: skip
            values = scored(f"plan {point.name}")
        points.append({"name": point.name, "budget": point.budget, "kv_ratio": point.kv_ratio, "perplexity": values,
                       "dropped_attention_layers": point.dropped_attention, "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
    return {
        "kv_values_per_token": {"original": kept, "converted": kept - saved},
        "frontier": points,
        "block_influence": {"attention": attention_bi, "layer": layer_bi, "sequences": min(len(sequences), INFLUENCE_SEQUENCES)},
        "peers": [p.to_dict() for p in peers],
        "skipped": skipped,
    }


class QuantizedKV(nn.Module):
    """`model` generating with the 4-bit quantized KV cache of the kv-quantized peer (what
    `generate(cache_implementation="quantized")` builds), for the side-by-side speed run."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False, **kwargs):
        from transformers import QuantizedCache

        if use_cache and cache is None:
            cache = QuantizedCache(backend="quanto", config=self.config, nbits=KV_BITS)
        return self.model(input_ids, cache=cache, use_cache=use_cache, **kwargs)


def attention_free(original: nn.Module, layers: list[int]) -> nn.Module:
    """The attention-drop peer as a user would serve it: the remote code's attention-free layers at `layers` (no Q, K,
    V, O, no K/V cache), every other tensor the original's own (shared, not copied)."""
    config = converted_config(original.config, {"dropped_attention_layers": sorted(layers)})
    _, cls = family_of(config).remote_classes()
    with init_empty_weights():
        kept = set(cls(config).state_dict())
    return assemble(config, {k: v for k, v in original.state_dict().items() if k in kept})


def without_layers(original: nn.Module, layers: list[int]) -> nn.Module:
    """The layer-drop peer as ShortGPT ships it: the original's classes with `layers` deleted and the rest renumbered,
    every tensor the original's own (shared, not copied)."""
    config = copy.deepcopy(original.config)
    keep = [i for i in range(config.num_hidden_layers) if i not in set(layers)]
    renumber = {old: new for new, old in enumerate(keep)}
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    state = {}
    for name, tensor in original.state_dict().items():
        match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if match is None:
            state[name] = tensor
        elif int(match[1]) in renumber:
            state[f"model.layers.{renumber[int(match[1])]}.{match[2]}"] = tensor
    return assemble(config, state, cls=type(original))


def speed_peers(original: nn.Module, section: dict) -> dict[str, nn.Module]:
    """The peers the speed run times beside the original and the conversion: the dropping peers that save at least the
    conversion's KV cache (the ones that could dominate it) and the 4-bit KV cache original, each built as served."""
    values = section["kv_values_per_token"]
    own_ratio = values["converted"] / values["original"]
    models = {}
    for peer in section["peers"]:
        if peer["kind"] == "attention-drop" and peer["kv_ratio"] <= own_ratio + 1e-9:
            models[peer["name"]] = attention_free(original, peer["layers"])
        elif peer["kind"] == "layer-drop" and peer["kv_ratio"] <= own_ratio + 1e-9:
            models[peer["name"]] = without_layers(original, peer["layers"])
        elif peer["kind"] == "kv-quantized":
            models[peer["name"]] = QuantizedKV(original)
    return models


def perplexities_on(peer: dict, texts: list[dict]) -> list[float]:
    """A peer's perplexity on each of the report's gated texts, in their order (the peers were scored on the same
    texts in the same order, so a text renamed in the report after the run is found by its place)."""
    values = list(peer["perplexity"].values())
    return [peer["perplexity"].get(text["eval_text"], values[i]) for i, text in enumerate(texts)]


RIVAL_KINDS = ("attention-drop", "layer-drop", "key-pca")  # the training-free peers a conversion must beat at its own saving


def dominating(section: dict, converted: dict[str, float]) -> list[dict]:
    """The training-free rivals (dropping, PCA of the keys) that save at least the conversion's KV cache with a
    perplexity no higher on every gated text.
    (A quantized KV cache is not a rival but a partner: it stacks with the conversion's saving.)"""
    values = section["kv_values_per_token"]
    own_ratio = values["converted"] / values["original"]
    return [
        peer for peer in section["peers"]
        if peer["kind"] in RIVAL_KINDS and peer["kv_ratio"] <= own_ratio + 1e-9
        and all(peer["perplexity"][t] <= converted[t] for t in converted)
    ]  # fmt: skip


def log_verdict(section: dict, converted: dict[str, float]) -> list[dict]:
    """Say on the console whether a training-free peer dominates the conversion; returns the dominating peers."""
    beaten = dominating(section, converted)
    if beaten:
        names = "; ".join(beaten_peer["name"] for beaten_peer in beaten)
        console.log(
            f"[yellow]peers: this conversion is dominated: {names} saves at least as much KV cache with no higher "
            "perplexity on every gated text (see the card's trade-off table)[/]"
        )
    else:
        console.log("peers: no training-free peer at this KV saving matches the conversion's perplexity on every gated text")
    return beaten
