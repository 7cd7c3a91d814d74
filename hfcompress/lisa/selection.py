"""Which layers LISA shares: by the share ratio (the best-aligned first), an explicit list, or a perplexity search; and
the checks of a choice against the model (layer range, attention types, the chain cap).

Sharing across attention types: a shared layer reads the scores of the layer below over the keys that layer sees and
caches what that layer's cache keeps; a sliding-window layer and a full-attention one see (and keep) different keys.
So a layer is shared only when the layer below has its attention type; the ratio and the perplexity search skip the
others, and --lisa-layers naming one is refused.

`options` below is a LisaOptions (lisa/options.py, which imports this module for its model check).
"""

from collections.abc import Callable

from ..errors import HfcompressError
from ..conversion.layer_plan import chain_length, largest_within
from .similarity import LayerSimilarity


def select_layers(similarity: list[LayerSimilarity], num_layers: int, options) -> list[int]:
    """Explicit layers, or the share_ratio * L layers outside the protected shallow ones whose attention output
    is best reproduced by the head-aligned previous layer (what LISA keeps before any training)."""
    if options.layers is not None:
        check_shared_layers(options.layers, num_layers, {s.layer: s.shareable for s in similarity})
        return sorted(set(options.layers))
    options.validate()  # the ratio's range (LisaOptions owns its checks)
    count = round(options.ratio * num_layers)
    candidates = ranked_candidates(similarity, options)
    if count > len(candidates):
        raise HfcompressError(too_few_candidates(options, count, len(candidates)))
    return sorted(candidates[:count])


def check_drop_layers(layers: list[int], num_layers: int) -> None:
    """Refuse --drop-attention-layers the modeling cannot run: layer 0 keeps its attention (the cache counts tokens by it)."""
    bad = [layer for layer in layers if not 0 < layer < num_layers]
    if bad:
        raise HfcompressError(f"--drop-attention-layers {bad} are out of range: give layers 1..{num_layers - 1}.")


def too_few_candidates(options, count: int, candidates: int) -> str:
    """The refusal of a share ratio asking for `count` layers when only `candidates` can be shared."""
    return (
        f"--share-ratio {options.ratio} asks for {count} shared layers but only {candidates} are outside the "
        f"{options.protect_first} protected shallow layers and have the attention type of the layer below"
        + (f", with at most {options.max_chain} in a row: raise --lisa-max-chain." if options.max_chain else ".")
    )


def shareable_layers(attention_types: list[str]) -> dict[int, bool]:
    """Layer (1..L-1) -> whether it has the attention type of the layer below."""
    return {i: attention_types[i] == attention_types[i - 1] for i in range(1, len(attention_types))}


def check_shared_layers(layers: list[int], num_layers: int, shareable: dict[int, bool]) -> None:
    """Refuse explicit shared layers (--lisa-layers) outside 1..L-1 or across attention types."""
    bad = [layer for layer in layers if not 0 < layer < num_layers]
    if bad:
        raise HfcompressError(f"--lisa-layers {bad} are out of range: layers 1..{num_layers - 1} can be shared.")
    check_attention_types(layers, shareable)


def check_attention_types(layers: list[int], shareable: dict[int, bool]) -> None:
    """Refuse explicit shared layers whose layer below has another attention type (`shareable`: layer -> bool)."""
    bad = sorted({layer for layer in layers if not shareable[layer]})
    if bad:
        raise HfcompressError(
            f"--lisa-layers {bad} cannot be shared: a shared layer reuses the attention of the layer below, and "
            f"{'these layers have' if len(bad) > 1 else 'this layer has'} another attention type (sliding window or "
            "full) than the layer below."
        )


def ranked_candidates(similarity: list[LayerSimilarity], options) -> list[int]:
    """Layers outside the protected shallow ones that have the attention type of the layer below, best reproduced by
    the aligned previous layer first. With `max_chain`, a layer that would make a run of more consecutive shared
    layers than that with the better ones is left out (greedily, so every prefix is the capped choice of its size)."""
    candidates = [s for s in similarity if s.layer >= max(1, options.protect_first) and s.shareable]
    ranked = [s.layer for s in sorted(candidates, key=lambda s: s.aligned_output_error)]
    if options.max_chain is None:
        return ranked
    taken: list[int] = []
    for layer in ranked:
        if chain_length(set(taken) | {layer}, layer) <= options.max_chain:
            taken.append(layer)
    return taken


def most_with_max_chain(layers: list[int], max_chain: int) -> int:
    """The most of `layers` that can be shared with at most `max_chain` consecutive ones (an upper bound of the greedy
    choice, checked before calibration)."""
    ordered = sorted(layers)
    runs = [1] if ordered else []  # lengths of the runs of consecutive layers
    for below, layer in zip(ordered, ordered[1:]):
        if layer == below + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return sum(n - n // (max_chain + 1) for n in runs)


def search_layers_by_perplexity(
    ranked: list[int], perplexity_of: Callable[[list[int]], float], limit: float
) -> tuple[list[int], list[dict]]:
    """The most layers, taken in `ranked` order, whose converted model keeps perplexity_of(layers) <= limit.

    Binary search over the count (about log2(len(ranked)) fits), assuming that sharing more layers never lowers
    the perplexity; returns the choice and every probe made, for the report.
    """
    count, probes = largest_within(len(ranked), lambda n: perplexity_of(sorted(ranked[:n])), limit)
    return sorted(ranked[:count]), [{"count": p["count"], "layers": sorted(ranked[: p["count"]]), **p} for p in probes]
