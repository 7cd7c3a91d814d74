"""Low-rank keys' options (`--kv-budget`, `--kv-plan`): the whole model's KV cache as a fraction of the original's, and
how it is spent."""

from dataclasses import dataclass

from ..errors import HfcompressError
from ..conversion.options import option

# the narrowest latent a layer keeps: below it single layers' losses grow fast (benchmarks/results-key-compression*.md)
MIN_KEY_RANK = 8
KV_PLANS = ("keys", "keys-values", "joint")
# the plans that can go below half the cache (dropping attention, or narrowing the values too)
BELOW_HALF = ("keys-values", "joint")


@dataclass
class KeyOptions:
    # 1.0: off. The other methods' plans (shared, dropped attention) count towards it; the keys of the layers that keep
    # their attention are narrowed until the whole cache fits. 0.75 by default: SmolLM2 +1.5% / +1.1% distilled, within
    # the gate where every dropping peer at that saving costs +40% and more (README "Results")
    kv_budget: float = option(
        0.75, "KV cache a token, as a fraction of the original's: the keys of every attention layer are compressed (a "
        "Fisher-aligned latent, per-layer widths) until it fits, after sharing and dropping (1.0 = off)."
    )  # fmt: skip

    # how the budget is spent: "keys" narrows the keys of every layer by the Fisher surrogate of the keys alone;
    # "keys-values" the keys and the values of every layer, one budget over both by the same surrogate (at 0.6x on
    # SmolLM2, training-free: +12% against +21% for keys alone, benchmarks/results-value-compression.md); "joint"
    # chooses per layer among keep, low-rank keys (twelve widths, method.joint_widths) and dropping the attention, by
    # each action's measured effect on the layer's output, weighted by the loss gradient (joint.py)
    plan: str = option(
        "keys", "How --kv-budget is spent: keys (every layer's keys narrowed), keys-values (keys and values narrowed, "
        "for budgets near 0.6 and below) or joint (per layer: keep, low-rank keys or drop the attention, whichever "
        "costs least by measured effect).", "--kv-plan",
    )  # fmt: skip

    # percent: search the budget instead of taking it: the lowest, in steps of method.SEARCH_STEP from 1 down to
    # --kv-budget, whose plan keeps the perplexity on held-out calibration text (the selection tokens) within +PCT before
    # any training, which then only lowers it. None: --kv-budget is the budget
    ppl_budget: float | None = option(
        None, "Search the budget: the lowest, down to --kv-budget, whose plan keeps perplexity within +PCT on held-out "
        "calibration text before any training (a few scored plans; distillation then lowers it).", "--kv-ppl-budget",
    )  # fmt: skip

    def validate(self) -> "KeyOptions":
        if self.ppl_budget is not None and not self.ppl_budget > 0:
            raise HfcompressError(f"--kv-ppl-budget must be a percentage > 0, got {self.ppl_budget}.")
        if self.ppl_budget is not None and self.kv_budget == 1.0:
            raise HfcompressError(
                "--kv-ppl-budget searches budgets from 1.0 down to --kv-budget, which is 1.0 (off): give --kv-budget "
                "the lowest budget you accept, e.g. --kv-budget 0.5 --kv-plan keys-values."
            )
        if self.plan not in KV_PLANS:
            raise HfcompressError(f"Unknown --kv-plan '{self.plan}': choose one of {', '.join(KV_PLANS)}.")
        if not 0.5 < self.kv_budget <= 1.0 and not (self.plan in BELOW_HALF and 0.0 < self.kv_budget <= 1.0):
            raise HfcompressError(
                f"--kv-budget must be in (0.5, 1.0] (the values cache a token relative to the original's; the keys are "
                f"half of them, and compressing only them cannot go to 0.5; --kv-plan keys-values, which narrows the "
                f"values too, and joint, which also drops attention, take (0, 1.0]), got {self.kv_budget}."
            )
        return self

    def check_against_model(self, config) -> None:
        """The budget must leave every layer its values (keys-values: MIN_KEY_RANK of them) and MIN_KEY_RANK key values
        a token (a converted config: what sharing or dropping would save besides is not planned yet); the joint plan,
        which may drop every attention but layer 0's, must leave layer 0 its values and MIN_KEY_RANK key values."""
        if self.kv_budget == 1.0:
            return
        width, layers = key_width(config), config.num_hidden_layers
        keeping = 1 if self.plan == "joint" else layers
        values = MIN_KEY_RANK if self.plan == "keys-values" else width
        least = keeping * (values + MIN_KEY_RANK)
        if self.kv_budget * 2 * width * layers < least:
            who = "layer 0 (whose attention the joint plan keeps)" if self.plan == "joint" else "every layer"
            kept = f"at least {MIN_KEY_RANK} values" if self.plan == "keys-values" else f"its {width} values"
            raise HfcompressError(
                f"--kv-budget {self.kv_budget} is below what --kv-plan {self.plan} can reach on this model: {who} keeps "
                f"{kept} and at least {MIN_KEY_RANK} key values a token, {least / (2 * width * layers):.3f} "
                "of the original's cache; give a larger --kv-budget."
            )


def key_width(config) -> int:
    """Values of one token's keys in one layer: all KV heads side by side."""
    return config.num_key_value_heads * config.head_dim
