"""Low-rank keys as a pipeline unit (methods.Method): every attention layer that keeps its attention caches a latent of
its keys, z = B k, and its queries read RoPE(A z) (the remote code's `key_ranks`, modeling/lisa_attention.py).

    observe            C = E[k k^T] of the layer's pre-RoPE keys (after k_norm) on the calibration inputs
    backward pass      G = E[g g^T], g = d loss / d k (the key module's output gradient)
    plan               the KV values left for keys once the other methods planned (shared layers' low-rank keys, dropped
                       attentions) are spread over the layers by the Fisher surrogate (subspace.plan_sizes)
    apply              key_latent.proj_in = B, proj_out = A: the Fisher-aligned directions (subspace.KeySubspace)

The pre-RoPE latent was chosen over the RoPE-commuting one by measurement (docs/key-compression.md): at 0.75x KV on
SmolLM2, +2.6% against +37% held-out perplexity, training-free.
"""

from dataclasses import asdict, replace

import torch
from torch import nn

from ..conversion.atomic import save_atomic
from ..conversion.calibrate import LinearStats
from ..errors import HfcompressError
from ..conversion.layer_plan import kv_values
from ..conversion.methods import LayerContext, Method, Planner, register
from .options import MIN_KEY_RANK, KeyOptions, key_width
from .statistics import KeyStatistics
from .subspace import KeySubspace, plan_sizes

CRITERION, LAYOUT = "fisher", "pre"


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


@register
class KeysMethod(Method):
    name = "keys"
    order = 15  # after LISA (its shared and dropped layers count towards the budget), before FASC
    needs_gradients = True

    def __init__(self, options: KeyOptions) -> None:
        self.options = options
        self.ranks: dict[int, int] = {}
        self.factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: list[dict] = []
        self.values: dict[str, int] = {}

    @classmethod
    def from_options(cls, options) -> "KeysMethod":
        return cls(replace(options.keys))

    def active(self) -> bool:
        return self.options.kv_budget < 1.0

    def settings(self) -> dict:
        return {**asdict(self.options), "criterion": CRITERION, "layout": LAYOUT}

    def calibration_settings(self) -> dict:
        return {}  # C and G depend on the model and the calibration text only

    def observe(self, ctx: LayerContext) -> None:
        if not ctx.is_main:
            return
        with torch.no_grad():
            keys = pre_rope_keys(ctx.layer.self_attn, ctx.attention_input()).double().cpu()
        save_atomic({"C": keys.T @ keys / len(keys)}, self.store / f"keys-{ctx.index}.pt")

    def gradient_linears(self, ctx: LayerContext) -> dict[str, nn.Module]:
        attention = ctx.layer.self_attn
        norm = getattr(attention, "k_norm", None)
        module = attention.k_proj if norm is None else KeyOutput(norm, key_width(attention.config))
        return {f"{ctx.index}.self_attn.keys": module}

    def observe_gradients(self, ctx: LayerContext, stats: dict[str, LinearStats]) -> None:
        if not ctx.is_main:
            return
        entry = stats[f"{ctx.index}.self_attn.keys"]
        path = self.store / f"keys-{ctx.index}.pt"
        saved = torch.load(path)
        save_atomic({**saved, "G": (entry.gg / entry.tokens).cpu()}, path)

    def plan(self, planner: Planner) -> None:
        """Per layer that keeps its attention, its latent width: the budget's values, less what every layer's values and
        the other methods' layers keep, spread where the Fisher surrogate says the loss is."""
        config = planner.config
        width, layers = key_width(config), planner.num_layers
        dropped = set(planner.notes.get("dropped_attention_layers", []))
        shared = planner.notes.get("shared_kv_values", {})  # layer -> values a shared layer caches
        kept = [i for i in range(layers) if i not in dropped and i not in shared]
        budget = self.options.kv_budget * kv_values(config, 0, 0)["keep"] * layers
        for_keys = int(budget - sum(shared.values()) - width * len(kept))
        if for_keys < MIN_KEY_RANK * len(kept):
            raise HfcompressError(
                f"--kv-budget {self.options.kv_budget} leaves {max(for_keys, 0)} key values a token for the {len(kept)} "
                f"layers that keep their attention, fewer than {MIN_KEY_RANK} each: give a larger --kv-budget."
            )
        subspaces = []
        for idx in kept:
            saved = torch.load(self.store / f"keys-{idx}.pt")
            stats = KeyStatistics(C=saved["C"], q2=torch.zeros(0), G=saved["G"])
            subspaces.append(KeySubspace(stats, None, CRITERION, LAYOUT, config.head_dim))
        sizes = plan_sizes(subspaces, for_keys, floor=MIN_KEY_RANK)
        self.ranks, self.factors, self.rows = {}, {}, []
        for idx, sub, size in zip(kept, subspaces, sizes):
            self.rows.append({"layer": idx, "rank": size, "width": width, "surrogate_loss": sub.cost(size)})
            if size < width:
                self.ranks[idx] = size
                self.factors[idx] = latent_factors(sub, size)
        cached = sum(sizes) + width * len(kept) + sum(shared.values())
        self.values = {"original": kv_values(config, 0, 0)["keep"] * layers, "converted": cached}

    def touches(self, index: int) -> bool:
        return False  # apply needs no calibration inputs

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if ctx.index not in self.factors:
            return state
        down, up = self.factors[ctx.index]
        prefix = f"model.layers.{ctx.index}.self_attn.key_latent."
        return {**state, prefix + "proj_in.weight": down, prefix + "proj_out.weight": up}

    def changed_layers(self) -> dict[str, list[int]]:
        return {"low-rank keys": sorted(self.ranks)}

    def with_fewer_changes(self, options, count: int):
        """The key saving scaled by count / changed layers: a --kv-budget closer to 1 (the plan then narrows the keys
        of about as many layers, each less)."""
        budget = round(1.0 - (1.0 - self.options.kv_budget) * count / len(self.ranks), 4)
        return replace(options, keys=replace(options.keys, kv_budget=budget)), f"--kv-budget {budget:g}"

    def config_entries(self) -> dict:
        return {"key_ranks": {str(idx): rank for idx, rank in self.ranks.items()}} if self.ranks else {}

    def report(self) -> dict:
        return {
            "kv_budget": self.options.kv_budget, "criterion": CRITERION, "layout": "pre-RoPE latent, RoPE on the rebuilt keys",
            "kv_values_per_token": self.values, "layers": self.rows,
        }  # fmt: skip
