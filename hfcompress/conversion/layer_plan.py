"""The per-layer plan: keep a layer's attention, share it (LISA) or drop it, for the KV cache and compute it saves.

A shared layer keeps its V and caches low-rank keys instead of K (on SmolLM2: 252 of 384 values a token), a dropped
layer caches nothing and computes no attention. Which to do where is a trade of quality for cache, decided per layer
from what calibration measured (the costs below), then sized by `--share-ratio` (a count) or by the perplexity search
(`--lisa-ppl-budget`, over prefixes of the same ranked list, so more changes never undo fewer).

Estimated cost of an action, as the energy it changes in the residual stream at that layer, relative to the stream's:
- drop:  E|a|^2 / E|h + a|^2, with a the attention block's output and h its input (what ShortGPT's block influence
         measures by angle; `attention_energy` below);
- share: the same times the aligned output error (relative MSE of a before any fit) times FIT_RESIDUAL, the part of
         that error the fit leaves (measured on SmolLM2's default run: loss_final / loss_initial 0.06-0.10, median 0.07).
Actions are ranked by cost per KV value saved a token, cheapest first, and taken greedily where they do not conflict:
one action per layer, a shared layer's anchor (the layer below) keeps its attention, at most `max_chain` shared
layers in a row.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


# --layer-plan: what the ratio and the search may do to a layer ("share" keeps LISA's own ranking: lisa.ranked_candidates)
PLAN_KINDS = ("share", "drop", "mixed")
FIT_RESIDUAL = 0.07

Kind = Literal["share", "drop"]


@dataclass(frozen=True)
class Action:
    layer: int
    kind: Kind
    cost: float  # estimated relative residual-stream energy it changes
    saved: int  # KV cache values a token it saves


@dataclass
class LayerPlan:
    shared: list[int]
    dropped: list[int]

    def __len__(self) -> int:
        return len(self.shared) + len(self.dropped)


def kv_values(config, rank: int, key_heads: int, head_dim: int | None = None) -> dict[str, int]:
    """Values a token each kind of layer caches: a kept layer K and V, a shared one its low-rank K and V, a dropped none
    (`head_dim` for a config that has none: transformers' Qwen2)."""
    kv = config.num_key_value_heads * (head_dim or config.head_dim)
    return {"keep": 2 * kv, "share": key_heads * rank + kv, "drop": 0}


def ranked_actions(
    similarity: list, energy: dict[int, float], values: dict[str, int], kind: str, protect_first: int
) -> list[Action]:  # fmt: skip
    """Every allowed action outside the `protect_first` shallow layers, cheapest per value saved first. `similarity`:
    lisa.LayerSimilarity of layers 1..L-1; `energy`: layer -> E|a|^2 / E|h + a|^2; `kind`: "drop" or "mixed"."""
    first = max(1, protect_first)
    actions = []
    for s in similarity:
        if s.layer < first:
            continue
        if kind in ("share", "mixed") and s.shareable:
            cost = FIT_RESIDUAL * s.aligned_output_error * energy[s.layer]
            actions.append(Action(s.layer, "share", cost, values["keep"] - values["share"]))
        if kind in ("drop", "mixed"):
            actions.append(Action(s.layer, "drop", energy[s.layer], values["keep"]))
    return sorted(actions, key=lambda a: (a.cost / a.saved, a.layer))


def chain_length(layers: set[int], layer: int) -> int:
    """Length of the run of consecutive layers in `layers` that contains `layer`."""
    low, high = layer, layer
    while low - 1 in layers:
        low -= 1
    while high + 1 in layers:
        high += 1
    return high - low + 1


def take(actions: list[Action], count: int | None = None, max_chain: int | None = None) -> LayerPlan:
    """The first `count` actions (None: all) of `actions` that conflict with none taken before them."""
    shared: set[int] = set()
    dropped: set[int] = set()
    for action in actions:
        if count is not None and len(shared) + len(dropped) >= count:
            break
        layer = action.layer
        if layer in shared or layer in dropped:
            continue
        if action.kind == "share":
            if layer - 1 in dropped or (max_chain is not None and chain_length(shared | {layer}, layer) > max_chain):
                continue
            shared.add(layer)
        else:
            if layer + 1 in shared:
                continue
            dropped.add(layer)
    return LayerPlan(sorted(shared), sorted(dropped))


def plan_sequence(actions: list[Action], max_chain: int | None = None) -> list[LayerPlan]:
    """The plan of every size, 0.. the most: each one the plan of the size before plus one action."""
    plans = [LayerPlan([], [])]
    while True:
        bigger = take(actions, len(plans), max_chain)
        if len(bigger) < len(plans):
            return plans
        plans.append(bigger)


def selection_limit(planner, percent: float) -> tuple[float, float]:
    """(the original's selection perplexity, the limit `percent` above it) for a perplexity search (planner:
    methods.Planner; that the selection text holds one evaluation window is checked before calibration,
    preflight.check_search_text)."""
    base = planner.selection_perplexity([])
    return base, base * (1 + percent / 100)


def search_notes(planner) -> dict:
    """What the report keeps of the planner's notes about a perplexity search: the selection text's size."""
    return {k: planner.notes[k] for k in ("tokens", "context")}


def largest_within(most: int, value_of: Callable[[int], float], limit: float) -> tuple[int, list[dict]]:
    """The largest count 0..most whose value_of(count) <= limit, by binary search (about log2(most) calls), assuming
    the value never drops as the count grows; returns it and every probe {count, perplexity, within_budget}."""
    probes: list[dict] = []
    low, high = 0, most  # invariant: `low` fits the budget (0 always does)
    while low < high:
        count = (low + high + 1) // 2
        value = value_of(count)
        probes.append({"count": count, "perplexity": value, "within_budget": value <= limit})
        if value <= limit:
            low = count
        else:
            high = count - 1
    return low, probes
