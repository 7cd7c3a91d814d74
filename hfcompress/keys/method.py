"""Low-rank keys as a pipeline unit (methods.Method): every attention layer that keeps its attention caches a latent of
its keys, z = B k, and its queries read RoPE(A z) (the remote code's `key_ranks`, modeling/lisa_attention.py).

    observe            C = E[k k^T] of the layer's pre-RoPE keys (after k_norm) on the calibration inputs
    backward pass      G = E[g g^T], g = d loss / d k (the key module's output gradient)
    plan               the KV values left for keys once the other methods planned (shared layers' low-rank keys, dropped
                       attentions) are spread over the layers by the Fisher surrogate (subspace.plan_sizes)
    apply              key_latent.proj_in = B, proj_out = A: the Fisher-aligned directions (subspace.KeySubspace)

With `--kv-plan keys-values` the values of every layer get a latent too (z = B v cached, A z read; no RoPE, so nothing is
rotated): C and G of v_proj's output are observed alike, and one budget is spent over the keys' and the values'
directions by the same surrogate (plan_sizes over both; their losses are in the same units).

With `--kv-plan joint` the backward pass also measures, per layer, what each action does to the layer's output on the
calibration inputs (its keys on twelfths of their width in Fisher directions, or its attention dropped), weighted by
the loss gradient there (`action_costs`), and the plan chooses one action per layer under the budget (joint.py). The
estimates are of single actions, which interact: that plan, the keys plan and the keys-values plan at the same budget
are then scored for real on the selection tokens, and the best is kept (`KeysMethod.best_candidate`).

The pre-RoPE latent was chosen over the RoPE-commuting one by measurement (docs/key-compression.md): at 0.75x KV on
SmolLM2, +2.6% against +37% held-out perplexity, training-free.
"""

import math
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from ..conversion.atomic import save_atomic
from ..conversion.calibrate import LinearStats
from ..errors import HfcompressError
from ..conversion.layer_plan import kv_values, largest_within, search_notes, selection_limit
from ..conversion.methods import FrontierPoint, LayerContext, Method, Planner, register
from ..lisa.weights import without_attention
from ..progress import console
from ..remote import import_remote
from .joint import Option, plan_layers
from .options import MIN_KEY_RANK, KeyOptions, key_width
from .statistics import KeyStatistics
from .subspace import KeySubspace, plan_sizes

CRITERION, LAYOUT = "fisher", "pre"
# the joint plan's latent widths: twelfths of the layer's key width (multiples of 8) and MIN_KEY_RANK, twelve
# measured actions a layer at any width (SmolLM2's 192: 8, 16, 32, ..., 176)
JOINT_STEPS = 12
SEARCH_STEP = 0.025  # --kv-ppl-budget's resolution, in fractions of the original's KV cache
# the budgets the card's frontier scores this conversion's plan at, training-free (beside its own)
FRONTIER_BUDGETS = (0.9, 0.75, 0.6, 0.5)


class KeyOutput:
    """What the backward pass tracks as a "linear" when a layer's keys come out of a k_norm: its input and output are
    the KV heads' keys side by side (`width`), token by token (the converted classes normalise before moving heads)."""

    def __init__(self, module: nn.Module, width: int):
        self.module, self.in_features, self.out_features = module, width, width

    def register_forward_hook(self, hook):
        return self.module.register_forward_hook(hook)


def pre_rope_keys(attention: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(tokens, width) keys of a converted-class attention on inputs x (..., hidden), before RoPE, after any k_norm."""
    key = attention.k_proj(x).view(*x.shape[:-1], -1, attention.head_dim)
    norm = getattr(attention, "k_norm", None)
    return (norm(key) if norm is not None else key).flatten(-2).reshape(-1, key.shape[-2] * key.shape[-1])


def latent_factors(sub: KeySubspace, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) of the first `rank` directions, each latent coordinate scaled to unit second moment on the calibration
    keys (the projector A B is unchanged; a float16 or quantized cache sees values of one scale)."""
    down, up = sub.down[:rank], sub.up[:, :rank]
    scale = torch.einsum("rw,wv,rv->r", down, sub.C, down).clamp_min(1e-30).rsqrt()
    return (down * scale[:, None]).float(), (up / scale).float()


def joint_widths(width: int) -> list[int]:
    """The latent widths the joint plan measures for keys `width` values wide."""
    steps = {max(MIN_KEY_RANK, round(width * k / JOINT_STEPS / 8) * 8) for k in range(1, JOINT_STEPS)}
    return sorted({MIN_KEY_RANK, *steps} - {width})


def action_costs(
    ctx: LayerContext, sub: KeySubspace, widths: list[int], hidden: torch.Tensor, grad: torch.Tensor
) -> dict[str, float]:  # fmt: skip
    """Per action on layer `ctx.index` alone (its attention dropped: "drop"; its keys on n Fisher directions: "n"), the
    loss change it causes, estimated from what it does to the layer's output on the calibration inputs `hidden`, Δ, and
    the loss gradient there, `grad` (g, of the summed loss): per token the first-order change g.Δ plus the Gauss-Newton
    term of the token's empirical Fisher, (g.Δ)^2 / 2, summed over the tokens and divided by their count (mean nats a
    token).
    Unlike the keys' own surrogate it sees the softmax, the output projection and the MLP after them, and prices a
    dropped attention in the same units (benchmarks/joint_plan.py compares both with the loss itself)."""
    layer, attention = ctx.layer, ctx.layer.self_attn
    tokens = hidden.shape[0] * hidden.shape[1]
    fasc_linear = import_remote("lisa_attention").FascLinear
    with torch.no_grad():
        base = ctx.run_layer(layer, hidden)

        def cost(out: torch.Tensor) -> float:
            dot = (grad * (out - base)).sum(-1).double()
            return float(dot.sum() + dot.pow(2).sum() / 2) / tokens

        costs = {"drop": cost(layer.after_attention(hidden, None))}
        for n in widths:
            down, up = latent_factors(sub, n)
            latent = fasc_linear(sub.width, sub.width, n).to(ctx.device)
            latent.proj_in.weight.copy_(down)
            latent.proj_out.weight.copy_(up)
            attention.key_latent = latent
            try:
                costs[str(n)] = cost(ctx.run_layer(layer, hidden))
            finally:
                attention.key_latent = None
    return costs


@dataclass
class KeyPlan:
    """One candidate plan of the layers that keep their attention: their key latent widths, their value latent widths
    (keys-values), the layers whose attention it drops (joint) and the estimated loss of each layer's action (joint)."""

    sizes: dict[int, int]
    value_sizes: dict[int, int] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    estimates: dict[int, float] = field(default_factory=dict)


@register
class KeysMethod(Method):
    name = "keys"
    order = 15  # after LISA (its shared and dropped layers count towards the budget), before FASC
    needs_gradients = True

    def __init__(self, options: KeyOptions) -> None:
        self.options = options
        self.ranks: dict[int, int] = {}
        self.value_ranks: dict[int, int] = {}
        self.dropped: list[int] = []  # the joint plan's dropped attentions
        self.factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.value_factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: list[dict] = []
        self.values: dict[str, int] = {}
        self.subspaces: dict[int, KeySubspace] = {}
        self.value_subspaces: dict[int, KeySubspace] = {}
        self.candidates: list[dict] = []  # the joint plan's candidates, scored
        self.chosen_plan = options.plan  # the joint plan's best candidate
        # what the plan step found, for plans at other budgets (frontier): the layers that keep their attention, the
        # shared layers' cached values, the key width, the joint plan's measured action costs
        self.kept: list[int] = []
        self.shared: dict[int, int] = {}
        self.width = 0
        self.costs: dict[int, dict] = {}
        self.budget = options.kv_budget  # the budget planned for: --kv-budget, or what --kv-ppl-budget's search found
        self.search: dict | None = None  # --kv-ppl-budget's probes
        self.scores: dict[tuple[str, float], float] = {}  # (candidate, budget) -> selection perplexity

    @classmethod
    def from_options(cls, options) -> "KeysMethod":
        return cls(replace(options.keys))

    def active(self) -> bool:
        return self.options.kv_budget < 1.0

    def settings(self) -> dict:
        return {**asdict(self.options), "criterion": CRITERION, "layout": LAYOUT}

    def calibration_settings(self) -> dict:
        # C and G depend on the model and the calibration text only; the keys-values and joint plans observe the values'
        # statistics besides, the joint plan measures its actions
        return {"plan": self.options.plan, "values": True} if self.options.plan != "keys" else {}

    def observe(self, ctx: LayerContext) -> None:
        if not ctx.is_main:
            return
        attention = ctx.layer.self_attn
        with torch.no_grad():
            x = ctx.attention_input()
            keys = pre_rope_keys(attention, x).double().cpu()
            saved = {"C": keys.T @ keys / len(keys)}
            if self.options.plan != "keys":
                values = attention.v_proj(x).reshape(-1, attention.v_proj.out_features).double().cpu()
                saved["Cv"] = values.T @ values / len(values)
        save_atomic(saved, self.store / f"keys-{ctx.index}.pt")

    def gradient_linears(self, ctx: LayerContext) -> dict[str, nn.Module]:
        attention = ctx.layer.self_attn
        norm = getattr(attention, "k_norm", None)
        module = attention.k_proj if norm is None else KeyOutput(norm, key_width(attention.config))
        values = {f"{ctx.index}.self_attn.v_proj": attention.v_proj} if self.options.plan != "keys" else {}
        return {f"{ctx.index}.self_attn.keys": module, **values}

    def observe_gradients(self, ctx: LayerContext, stats: dict[str, LinearStats]) -> None:
        entry = stats[f"{ctx.index}.self_attn.keys"]
        path = self.store / f"keys-{ctx.index}.pt"
        G = (entry.gg / entry.tokens).cpu()
        if self.options.plan == "joint":  # collectives: every process takes part
            hidden, grad = ctx.hidden_input(), ctx.output_gradient()
        if not ctx.is_main:
            return
        saved, costs = torch.load(path), {}
        if self.options.plan != "keys":
            values = stats[f"{ctx.index}.self_attn.v_proj"]
            saved["Gv"] = (values.gg / values.tokens).cpu()
        if self.options.plan == "joint":
            stats = KeyStatistics(C=saved["C"], q2=torch.zeros(0), G=G)
            sub = KeySubspace(stats, None, CRITERION, LAYOUT, ctx.layer.self_attn.head_dim)
            costs = action_costs(ctx, sub, joint_widths(sub.width), hidden, grad)
        save_atomic({**saved, "G": G, "costs": costs}, path)

    def plan(self, planner: Planner) -> None:
        """Per layer that keeps its attention, its latent widths (or its attention dropped), by the --kv-plan:
        keys          the budget's values, less what every layer's values and the other methods' layers keep, spread
                      over the keys where the Fisher surrogate says the loss is;
        keys-values   one budget over the keys' and the values' directions by the same surrogate;
        joint         one action per layer, keep, a key latent width or drop, of least estimated loss within the budget;
                      then this plan and the two above (where the budget lets them) are scored for real on the
                      selection tokens (the other methods' changes not applied), and the best is kept: the estimates
                      are of single actions, which interact, so the joint plan is never worse there than its parts.
        The budget is --kv-budget, or with --kv-ppl-budget the lowest down to it whose plan keeps the selection
        perplexity within that percentage (search_budget)."""
        config = planner.config
        self.width, layers = key_width(config), planner.num_layers
        dropped = set(planner.notes.get("dropped_attention_layers", []))
        self.shared = planner.notes.get("shared_kv_values", {})  # layer -> values a shared layer caches
        self.kept = [i for i in range(layers) if i not in dropped and i not in self.shared]
        saved = {idx: torch.load(self.store / f"keys-{idx}.pt") for idx in self.kept}
        self.costs = {idx: s["costs"] for idx, s in saved.items()} if self.options.plan == "joint" else {}

        def subspaces_of(c: str, g: str) -> dict[int, KeySubspace]:
            return {
                idx: KeySubspace(KeyStatistics(C=s[c], q2=torch.zeros(0), G=s[g]), None, CRITERION, LAYOUT, config.head_dim)
                for idx, s in saved.items()
            }  # fmt: skip

        self.subspaces = subspaces_of("C", "G")
        self.value_subspaces = subspaces_of("Cv", "Gv") if self.options.plan != "keys" else {}
        self.values = {"original": kv_values(config, 0, 0)["keep"] * layers}
        self.budget = self.search_budget(planner) if self.options.ppl_budget is not None else self.options.kv_budget
        candidates = self.candidate_plans(self.budget)
        self.chosen_plan = self.best_candidate(planner, candidates)
        plan = candidates[self.chosen_plan]
        self.dropped = plan.dropped
        if self.dropped:  # FASC (planned next) leaves a dropped attention's linears alone
            planner.notes["dropped_attention_layers"] = sorted({*dropped, *self.dropped})
        self.set_plan(plan)
        self.values["converted"] = self.cached_values(plan)

    def cached_values(self, plan: "KeyPlan") -> int:
        """Values a token the whole model caches with `plan` (the shared layers' included)."""
        width = self.width
        return sum(plan.sizes.values()) + sum(plan.value_sizes.get(idx, width) for idx in plan.sizes) + sum(self.shared.values())

    def candidate_plans(self, budget: float) -> dict[str, "KeyPlan"]:
        """The plans to choose from at `budget`: the --kv-plan's own; for joint, the joint plan and the keys and
        keys-values plans where the budget lets them. HfcompressError where the --kv-plan's own cannot reach it."""
        candidates = {self.options.plan: self.plan_named(self.options.plan, budget)}
        if self.options.plan == "joint":
            for name in ("keys", "keys-values"):
                try:
                    candidates[name] = self.plan_named(name, budget)
                except HfcompressError:
                    continue  # below what that plan reaches
        return candidates

    def search_budget(self, planner: Planner) -> float:
        """--kv-ppl-budget: the lowest budget, in steps of SEARCH_STEP from 1 down to --kv-budget, whose plan (the best
        candidate, for joint) keeps the selection perplexity within the limit, training-free. A binary search over the
        steps (about log2 of their count, each a streamed pass over the selection tokens), assuming a smaller budget
        never scores better; every probe is reported."""
        base, limit = selection_limit(planner, self.options.ppl_budget)
        floor = self.options.kv_budget
        steps = math.ceil((1.0 - floor) / SEARCH_STEP - 1e-9)

        def budget_at(step: int) -> float:
            return max(round(1.0 - step * SEARCH_STEP, 4), floor)

        def perplexity_at(step: int) -> float:
            try:
                candidates = self.candidate_plans(budget_at(step))
            except HfcompressError:
                return math.inf  # below what the plan reaches on this model
            return min(self.score(planner, name, budget_at(step), plan) for name, plan in candidates.items())

        step, probes = largest_within(steps, perplexity_at, limit)
        self.search = {
            "ppl_budget": self.options.ppl_budget, "original_perplexity": base, "limit": limit, "floor": floor, "step": SEARCH_STEP,
            "probes": [
                {"budget": budget_at(p["count"]), "within_budget": p["within_budget"],
                 "perplexity": p["perplexity"] if math.isfinite(p["perplexity"]) else None}  # None: the plan cannot reach it
                for p in probes
            ],
            **search_notes(planner),
        }  # fmt: skip
        console.log(f"kv search: --kv-budget {budget_at(step):g} within +{self.options.ppl_budget:g}% ({len(probes)} probes)")
        return budget_at(step)

    def score(self, planner: Planner, name: str, budget: float, plan: "KeyPlan") -> float:
        """Selection perplexity of `plan` (candidate `name` at `budget`) applied alone, training-free; each scored
        once."""
        if (name, budget) not in self.scores:
            variant = KeysMethod(self.options)
            variant.store, variant.subspaces, variant.value_subspaces = self.store, self.subspaces, self.value_subspaces
            variant.width, variant.dropped = self.width, plan.dropped
            variant.set_plan(plan)
            self.scores[name, budget] = planner.selection_perplexity([variant])
            console.log(f"kv plan: {name} at {budget:g}: selection perplexity {self.scores[name, budget]:.3f}")
        return self.scores[name, budget]

    def plan_named(self, name: str, budget: float) -> "KeyPlan":
        """The plan `name` (keys, keys-values, joint) of the layers that keep their attention, for the whole model's
        KV cache at `budget` of the original's; HfcompressError where it cannot reach that."""
        values = budget * self.values["original"] - sum(self.shared.values())
        if name == "joint":
            chosen = self.joint_plan(values, budget)
            return KeyPlan(
                dropped=sorted(idx for idx, option in chosen.items() if option.action == "drop"),
                sizes={idx: option.width or self.width for idx, option in chosen.items() if option.action != "drop"},
                estimates={idx: max(option.cost, 0.0) for idx, option in chosen.items()},
            )  # fmt: skip
        return self.surrogate_plan(name, values, budget)

    def surrogate_plan(self, name: str, values: float, budget: float) -> "KeyPlan":
        """The widths of plan `name` (keys, keys-values) for `values` cached values a token over the kept layers."""
        values, kept, width = int(values), self.kept, self.width
        if name == "keys-values":
            if values < 2 * MIN_KEY_RANK * len(kept):
                raise HfcompressError(
                    f"--kv-budget {budget:g} leaves {max(values, 0)} key and value values a token for the {len(kept)} "
                    f"layers that keep their attention, fewer than {MIN_KEY_RANK} of each: give a larger --kv-budget."
                )  # fmt: skip
            subs = [*(self.subspaces[i] for i in kept), *(self.value_subspaces[i] for i in kept)]
            both = plan_sizes(subs, values, floor=MIN_KEY_RANK)
            return KeyPlan(sizes=dict(zip(kept, both[: len(kept)])), value_sizes=dict(zip(kept, both[len(kept) :])))
        for_keys = values - width * len(kept)
        if for_keys < MIN_KEY_RANK * len(kept):
            raise HfcompressError(
                f"--kv-budget {budget:g} leaves {max(for_keys, 0)} key values a token for the {len(kept)} layers that "
                f"keep their attention, fewer than {MIN_KEY_RANK} each: give a larger --kv-budget, or --kv-plan "
                "keys-values or joint."
            )  # fmt: skip
        return KeyPlan(sizes=dict(zip(kept, plan_sizes([self.subspaces[i] for i in kept], for_keys, floor=MIN_KEY_RANK))))

    def frontier(self) -> list[FrontierPoint]:
        """The plan this conversion chose at FRONTIER_BUDGETS and at its own budget, each it reaches: per point the
        projectors on the original's keys and values that its latents give, and the attentions it drops."""
        points = []
        for budget in sorted({*FRONTIER_BUDGETS, self.budget}, reverse=True):
            try:
                plan = self.plan_named(self.chosen_plan, budget)
            except HfcompressError:
                continue  # below what this plan reaches on this model
            points.append(FrontierPoint(
                f"{self.chosen_plan} at {budget:g}", budget, self.cached_values(plan) / self.values["original"],
                key_projectors={i: self.subspaces[i].projector(n) for i, n in plan.sizes.items() if n < self.width},
                value_projectors={i: self.value_subspaces[i].projector(n) for i, n in plan.value_sizes.items() if n < self.width},
                dropped_attention=plan.dropped,
            ))  # fmt: skip
        return points

    def best_candidate(self, planner: Planner, candidates: dict[str, "KeyPlan"]) -> str:
        """The candidate of least selection perplexity (each applied alone, training-free), recorded for the report."""
        if len(candidates) == 1:
            return next(iter(candidates))
        self.candidates = [
            {"plan": name, "selection_perplexity": self.score(planner, name, self.budget, plan), "dropped_attention_layers": plan.dropped}
            for name, plan in candidates.items()
        ]  # fmt: skip
        return min(self.candidates, key=lambda row: row["selection_perplexity"])["plan"]

    def set_plan(self, plan: "KeyPlan") -> None:
        """The ranks, factors and report rows of `plan`."""
        self.ranks, self.factors, self.rows = {}, {}, []
        self.value_ranks, self.value_factors = {}, {}
        width = self.width
        for idx in sorted([*plan.sizes, *plan.dropped]):
            if idx in plan.dropped:
                row = {"layer": idx, "action": "drop", "rank": 0, "width": width, "estimated_loss": plan.estimates[idx]}
                self.rows.append(row)
                continue
            size, sub = plan.sizes[idx], self.subspaces[idx]
            value_size = plan.value_sizes.get(idx, width)
            action = "keys" if size < width else "keep"
            row = {"layer": idx, "action": action, "rank": size, "width": width, "surrogate_loss": sub.cost(size)}
            if idx in self.value_subspaces:
                row.update(value_rank=value_size, value_surrogate_loss=self.value_subspaces[idx].cost(value_size))
            self.rows.append({**row, "estimated_loss": plan.estimates[idx]} if idx in plan.estimates else row)
            if size < width:
                self.ranks[idx] = size
                self.factors[idx] = latent_factors(sub, size)
            if value_size < width:
                self.value_ranks[idx] = value_size
                self.value_factors[idx] = latent_factors(self.value_subspaces[idx], value_size)

    def joint_plan(self, values: float, budget: float) -> dict[int, Option]:
        """One Option per layer that keeps its attention: keep, keys at a latent width or drop (not layer 0, whose
        attention every model keeps, nor below a shared layer: it reads the attention of the layer below), least summed
        estimated loss within `values` cached a token (the whole model's `budget`)."""
        anchors, width = {0, *(layer - 1 for layer in self.shared)}, self.width
        menus = {}
        for idx, measured in self.costs.items():
            menu = [Option("keep", 2 * width, 0.0)]
            menu += [Option("keys", width + n, measured[str(n)], n) for n in joint_widths(width)]
            menus[idx] = menu + ([Option("drop", 0, measured["drop"])] if idx not in anchors else [])
        try:
            return plan_layers(menus, values)
        except ValueError:
            raise HfcompressError(
                f"--kv-budget {budget:g} is below what this model can reach with the layers LISA shares "
                "(they keep their cache, and so do the layers they read): give a larger --kv-budget."
            ) from None

    def touches(self, index: int) -> bool:
        return False  # apply needs no calibration inputs

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if ctx.index in self.dropped:
            return without_attention(state, ctx.layer)
        state = dict(state)
        for kind, factors in (("key", self.factors), ("value", self.value_factors)):
            if ctx.index in factors:
                down, up = factors[ctx.index]
                prefix = f"model.layers.{ctx.index}.self_attn.{kind}_latent."
                state.update({prefix + "proj_in.weight": down, prefix + "proj_out.weight": up})
        return state

    def changed_layers(self) -> dict[str, list[int]]:
        return {
            "low-rank keys": sorted(self.ranks), "low-rank values": sorted(self.value_ranks),
            "attention dropped (KV plan)": self.dropped,
        }  # fmt: skip

    def with_fewer_changes(self, options, count: int):
        """The saving scaled by count / changed layers (a layer's keys and its values count apart, as the back-off
        counts them): a --kv-budget closer to 1 (the plan then narrows about as many latents, each less)."""
        changed = len(self.ranks) + len(self.value_ranks) + len(self.dropped)
        budget = round(1.0 - (1.0 - self.budget) * count / changed, 4)
        # a searched budget is replaced by the raised one: the next attempt converts at it, searching nothing
        return replace(options, keys=replace(options.keys, kv_budget=budget, ppl_budget=None)), f"--kv-budget {budget:g}"

    def config_entries(self) -> dict:
        entries = {"key_ranks": {str(idx): rank for idx, rank in self.ranks.items()}} if self.ranks else {}
        if self.value_ranks:
            entries["value_ranks"] = {str(idx): rank for idx, rank in self.value_ranks.items()}
        return {**entries, "dropped_attention_layers": self.dropped} if self.dropped else entries

    def report(self) -> dict:
        return {
            "kv_budget": self.budget, "plan": self.options.plan, "chosen_plan": self.chosen_plan, "search": self.search,
            "dropped_attention_layers": self.dropped,
            "criterion": CRITERION, "layout": "pre-RoPE latent, RoPE on the rebuilt keys",
            "kv_values_per_token": self.values, "layers": self.rows, "candidates": self.candidates,
        }  # fmt: skip
