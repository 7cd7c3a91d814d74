"""LISA as a pipeline unit (methods.Method): similarity (and each attention block's energy) in the forward pass, the
per-layer plan (keep, share or drop the attention) in plan, the fits and the drops in apply, its config keys and report."""

from dataclasses import asdict, replace

import torch

from ..conversion.calibrate import cache_key, load_or_compute
from ..errors import HfcompressError
from ..conversion.layer_plan import (
    LayerPlan, kv_values, largest_within, plan_sequence, ranked_actions, search_notes, selection_limit,
)
from ..conversion.methods import LayerContext, Method, Planner, register
from ..progress import console
from .fit import FittedLayer, fit_inputs, fit_shared_layer, shared_attention
from .handoff import Below, handed_over
from .options import SELECTION_ONLY, LisaOptions
from .rank import lowrank_key_heads, lowrank_rank
from .selection import check_drop_layers, ranked_candidates, search_layers_by_perplexity, select_layers
from .similarity import SIMILARITY_SEQUENCES, LayerSimilarity, attention_energy, layer_similarity
from .weights import replace_qk, shared_qk_parameters, without_attention


@register
class LisaMethod(Method):
    """LISA as a pipeline unit: similarity (and each attention block's energy) in the forward pass, the per-layer plan
    (keep, share or drop the attention) in plan, the fits and the drops in apply."""

    name = "lisa"
    order = 10

    def __init__(self, options: LisaOptions, layers: list[int] | None = None, dropped: list[int] | None = None) -> None:
        self.options = options
        self.fixed_layers = layers  # a candidate plan scored by the perplexity search
        self.fixed_dropped = dropped
        self.config = None
        self.chosen: list[int] = []
        self.dropped: list[int] = []  # layers whose attention is dropped
        self.rank = 0
        self.search: dict | None = None
        self.records: list[FittedLayer] = []  # fit records of the layers converted so far (weights dropped)
        self.qk_params: list[int] = []
        self.below: Below | None = None  # what the converted layer below hands over, on calibration inputs
        self._previous: tuple[int, tuple[torch.Tensor, torch.Tensor, int | None]] | None = None
        self.similarity: list[LayerSimilarity] = []

    @classmethod
    def from_options(cls, options) -> "LisaMethod":
        return cls(replace(options.lisa, seed=options.seed))

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self.options).items() if k not in SELECTION_ONLY}

    def calibration_settings(self) -> dict:
        return {}  # the similarity depends on the model and the calibration text only; fits are keyed by settings()

    def check_model(self, config) -> None:
        self.config = config

    def observe(self, ctx: LayerContext) -> None:
        """Similarity of this layer's attention to the layer below's (nothing for layer 0)."""
        x = ctx.attention_input()[:SIMILARITY_SEQUENCES]
        previous = None
        if ctx.index > 0:
            if self._previous is None or self._previous[0] != ctx.index - 1:  # resumed: recompute the layer below
                below = ctx.previous()
                x_below = below.attention_input()[:SIMILARITY_SEQUENCES]
                _, scores = layer_similarity(below.index, below.layer.self_attn, x_below, below.cos_sin(x.shape[1]), None)
                self._previous = (below.index, scores)
            previous = self._previous[1]
        similarity, scores = layer_similarity(ctx.index, ctx.layer.self_attn, x, ctx.cos_sin(x.shape[1]), previous)
        self._previous = (ctx.index, scores) if ctx.index + 1 < ctx.num_layers else None
        if similarity is not None:
            hidden = ctx.hidden_input()[:SIMILARITY_SEQUENCES]
            similarity.attention_energy = attention_energy(ctx.layer.self_attn, x, hidden, ctx.cos_sin(x.shape[1]))
        if ctx.is_main and similarity is not None:
            torch.save(similarity, self.store / f"similarity-{ctx.index}.pt")

    def plan(self, planner: Planner) -> None:
        config, options = planner.config, self.options
        if not self.similarity:
            self.similarity = [torch.load(self.store / f"similarity-{i}.pt", weights_only=False) for i in range(1, planner.num_layers)]
        fixed_drops = sorted(set(options.drop_layers or []))
        check_drop_layers(fixed_drops, planner.num_layers)
        # the layers a plan may still change: not dropped by --drop-attention-layers, nor right above such a layer
        similarity = [s for s in self.similarity if s.layer not in fixed_drops and s.layer - 1 not in fixed_drops]
        self.dropped = fixed_drops
        if self.fixed_layers is not None:
            self.chosen, self.dropped = sorted(self.fixed_layers), sorted(self.fixed_dropped or [])
        elif options.layers is not None:
            self.chosen = select_layers(self.similarity, planner.num_layers, options)
            clash = sorted({layer for layer in self.chosen if layer in fixed_drops or layer - 1 in fixed_drops})
            if clash:
                raise HfcompressError(
                    f"--lisa-layers {clash} cannot be shared: the layer or the layer below it is in --drop-attention-"
                    "layers, and a shared layer reads the attention of the layer below."
                )
        elif options.plan != "share":
            plan = self.plan_layers(planner, similarity)
            self.chosen, self.dropped = plan.shared, sorted({*plan.dropped, *fixed_drops})
        elif options.ppl_budget is not None:
            def perplexity_of(layers: list[int]) -> float:
                return self.score(planner, layers, fixed_drops)

            base, limit = selection_limit(planner, options.ppl_budget)
            self.chosen, probes = search_layers_by_perplexity(ranked_candidates(similarity, options), perplexity_of, limit)
            self.search = {"original_perplexity": base, "limit": limit, "probes": probes, **search_notes(planner)}
            console.log(f"lisa search: {len(self.chosen)} layers within +{options.ppl_budget:g}% ({len(probes)} fits)")
        else:
            self.chosen = select_layers(similarity, planner.num_layers, options)
        self.rank = lowrank_rank(config, options.qk_compression, options.lowrank_keys) if self.chosen and options.lowrank else 0
        self.config = config
        self.records, self.qk_params, self.below = [], [], None
        planner.notes["dropped_attention_layers"] = self.dropped  # FASC leaves a dropped attention's linears alone
        # what each shared layer caches a token: the low-rank keys' budget counts it (keys/method.py)
        share = kv_values(config, self.rank, lowrank_key_heads(config, options.lowrank_keys))["share"]
        planner.notes["shared_kv_values"] = dict.fromkeys(self.chosen, share)

    def score(self, planner: Planner, layers: list[int], dropped: list[int]) -> float:
        """Selection perplexity of this method with the candidate plan (`layers` shared, `dropped` dropped)."""
        variant = LisaMethod(self.options, layers, dropped)
        variant.similarity, variant.store = self.similarity, self.store
        variant.plan(planner)
        return planner.selection_perplexity([variant])

    def plan_layers(self, planner: Planner, similarity: list[LayerSimilarity]) -> LayerPlan:
        """--layer-plan drop | mixed: actions ranked by estimated cost per KV value saved (layer_plan.py), as many as
        the ratio asks, or the most whose selection perplexity stays within --lisa-ppl-budget."""
        config, options = planner.config, self.options
        rank = lowrank_rank(config, options.qk_compression, options.lowrank_keys) if options.lowrank else 0
        values = kv_values(config, rank, lowrank_key_heads(config, options.lowrank_keys))
        energy = {s.layer: s.attention_energy for s in similarity}
        plans = plan_sequence(ranked_actions(similarity, energy, values, options.plan, options.protect_first), options.max_chain)
        fixed_drops = sorted(set(options.drop_layers or []))
        if options.ppl_budget is None:
            count = round(options.ratio * planner.num_layers)
            if count >= len(plans):
                raise HfcompressError(
                    f"--share-ratio {options.ratio} asks for {count} changed layers but --layer-plan {options.plan} can "
                    f"change only {len(plans) - 1} outside the {options.protect_first} protected shallow layers: lower "
                    "--share-ratio."
                )
            return plans[count]

        def perplexity_of(count: int) -> float:
            return self.score(planner, plans[count].shared, sorted({*plans[count].dropped, *fixed_drops}))

        base, limit = selection_limit(planner, options.ppl_budget)
        count, probes = largest_within(len(plans) - 1, perplexity_of, limit)
        probes = [{"count": p["count"], "layers": plans[p["count"]].shared, "dropped": plans[p["count"]].dropped, **p} for p in probes]
        self.search = {"original_perplexity": base, "limit": limit, "probes": probes, **search_notes(planner)}
        plan = plans[count]
        console.log(
            f"layer plan: {len(plan.shared)} shared, {len(plan.dropped)} dropped within +{options.ppl_budget:g}% "
            f"({len(probes)} probes)"
        )
        return plan

    def touches(self, index: int) -> bool:
        return index in self.chosen or index + 1 in self.chosen or index in self.dropped

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx = ctx.index
        if idx in self.dropped:
            self.below = None
            return without_attention(state, ctx.layer)
        if not self.touches(idx):
            self.below = None
            return state
        x = fit_inputs(ctx.attention_input(), self.options)
        cos_sin = ctx.cos_sin(x.shape[1])
        module = ctx.layer.self_attn
        if idx in self.chosen:
            matching = next(s.matching for s in self.similarity if s.layer == idx)
            below = [layer for layer in self.chosen if layer <= idx]  # a fit depends on its anchors: the chain below

            def fit() -> FittedLayer:
                return fit_shared_layer(self.config, module, cos_sin, idx, x, self.below, matching, self.rank, self.options)[1]

            record = load_or_compute(self.store / f"fit-{cache_key(below, self.settings())}.pt", fit)
            module = shared_attention(self.config, record, ctx.device)
            state = replace_qk(state, record)
            self.qk_params.append(shared_qk_parameters(record))
            self.records.append(replace(record, state={}))
        below = self.below if idx in self.chosen else None
        self.below = handed_over(module, x, below, cos_sin, self.options) if idx + 1 in self.chosen else None
        return state

    def config_entries(self) -> dict:
        """The planned shared layers (known once plan has run, before any fit)."""
        align = "dense" if self.options.align == "dense" else "sparse"
        hidden = self.options.align_hidden if align == "dense" else 0
        spec = {"rank": self.rank, "align": align, "align_hidden": hidden}
        if self.options.lowrank_keys != "head":
            spec["key_heads"] = lowrank_key_heads(self.config, self.options.lowrank_keys)
        entries = {"lisa_layers": {str(layer): dict(spec) for layer in self.chosen}}
        if self.dropped:
            entries["dropped_attention_layers"] = list(self.dropped)
        return entries

    def resume_state(self) -> dict:
        return {"records": self.records, "qk_params": self.qk_params, "below": self.below}

    def restore(self, state: dict) -> None:
        self.records, self.qk_params, self.below = state["records"], state["qk_params"], state["below"]

    def changed_layers(self) -> dict[str, list[int]]:
        fixed = set(self.options.drop_layers or [])  # --drop-attention-layers: the user's, not the plan's
        return {"shared": self.chosen, "attention dropped": [layer for layer in self.dropped if layer not in fixed]}

    def with_fewer_changes(self, options, count: int):
        if self.options.layers is not None or self.options.ppl_budget is not None:
            return None  # the layers are the user's list, or the search's choice: no count to lower
        fewer = replace(options, lisa=replace(options.lisa, share_ratio=count / self.config.num_hidden_layers))
        return fewer, f"{count} changed layers"

    def report(self) -> dict:
        config = self.config
        dense_qk = config.hidden_size * config.head_dim * (config.num_attention_heads + config.num_key_value_heads)
        return {
            "layers": self.chosen,
            "dropped_attention_layers": self.dropped,
            "layer_plan": self.options.plan,
            "perplexity_search": self.search,
            "rank": self.records[0].rank if self.records else None,
            "options": asdict(self.options),
            "similarity": [s.to_dict() for s in self.similarity],
            "fitted": [{k: v for k, v in asdict(r).items() if k != "state"} for r in self.records],
            "qk_compression_measured": (dense_qk / max(self.qk_params)) if self.qk_params else None,
        }
