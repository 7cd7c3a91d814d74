"""LISA's options (`--share-ratio`, `--lisa-*`, ...): every field's default and help, their range checks (`validate`)
and the check against the model (`check_against_model`). The defaults live here and nowhere else."""

from dataclasses import dataclass

from ..errors import HfcompressError
from ..conversion.layer_plan import PLAN_KINDS
from ..conversion.options import at_least, option
from .rank import LOWRANK_KEYS, lowrank_rank
from .selection import check_drop_layers, check_shared_layers, most_with_max_chain, shareable_layers, too_few_candidates

# LISA is off by default: at the same KV cache low-rank keys alone cost a fraction of what sharing adds (SmolLM2 at
# 0.75x KV, distilled: keys +1.5% / +1.1%, 6 shared layers plus keys KL four times higher; README "Results")
DEFAULT_SHARE_RATIO = 0.0
# analyze's default: the layers a 20% share would take
SHOWN_SHARE_RATIO = 0.2
ALIGN_KINDS = ("dense", "sparse")
# LisaOptions that do not change a fit
SELECTION_ONLY = ("share_ratio", "layers", "protect_first", "ppl_budget", "max_chain", "plan", "drop_layers")


@dataclass
class LisaOptions:
    # fraction of layers shared, best aligned first (None: DEFAULT_SHARE_RATIO)
    share_ratio: float | None = option(
        None, f"Fraction of layers to share (LISA), best-aligned first (default {DEFAULT_SHARE_RATIO})."
    )
    # explicit choice instead of share_ratio
    layers: list[int] | None = option(None, "Explicit comma-separated layers to share (instead of --share-ratio).")
    # percent: share as many layers as keep perplexity within it (searched)
    ppl_budget: float | None = option(
        None, "Share as many layers as keep perplexity within +PCT (a search; instead of --share-ratio)."
    )
    protect_first: int = option(2, "Number of shallow layers never shared.")  # shallow layers are never shared
    # at most this many consecutive shared layers (None: no cap): in a chain each layer approximates the layer below's
    # approximation, and a sparse chain's prefill attention widens by r per layer (benchmarks/results-long-context.md)
    max_chain: int | None = option(None, "At most this many consecutive shared layers (default: no cap).")
    # shared Q/K parameters >= this many times smaller than W_Q + W_K. The paper's 6 gave SmolLM2 rank 6 per head; 3 with
    # keys per KV group gives rank 20 at about the same K cache (3 x 20 against 9 x 6 values a token): benchmarks/scaling.py
    qk_compression: float = option(3.0, "Shared layers' Q/K parameters are at least this many times smaller.")
    # sparse (one scaled head: SDPA fast path, the default) | dense (head mix + FFN)
    align: str = option("sparse", "Head alignment: dense or sparse (SDPA fast path).")
    # dense Align: FFN width across heads; 0 = linear head mix only
    align_hidden: int = option(16, "Width of the dense alignment FFN (0 = linear head mix only).")
    # research ablations, not on the CLI (research/inmemory.py ABLATIONS): no low-rank Q/K correction (aligned previous
    # scores only), and a sparse Align left at the identity (each head copies its own head below; neither matched nor
    # trained)
    lowrank: bool = True
    identity_align: bool = False
    # one low-rank key per KV "group" (GQA: a smaller cache, a higher rank), or per "head"
    lowrank_keys: str = option("group", "Low-rank keys of a shared layer: one per head, or per KV group.")
    # sparse Align: the query heads of one KV group read one KV head of the layer below, different groups different
    # ones, so a shared layer and its anchor fit in one vLLM paged cache of no more values a token than the
    # original layers (the vLLM plugin, vllm-plugin/; docs/serving-vllm.md); False: each head its best match anywhere
    group_heads: bool = option(
        False,
        "Sparse Align: the heads of one KV group read one KV head of the layer below, so vLLM caches no more than the "
        "original (docs/serving-vllm.md).",
    )
    # the fit was short of steps: 600 steps of one sequence beat 100 of four on held-out sequences, for about twice the
    # time (benchmarks/lisa_fit_budget.py)
    steps: int = option(600, "Adam steps of each shared layer's local fit.")
    batch_size: int = option(1, "Calibration sequences per step of a shared layer's local fit.")
    lr: float = 1e-2
    seed: int = 0  # the conversion's --seed
    # what --share-ratio and --lisa-ppl-budget may do to a layer: share it (LISA), drop its attention, or either, per
    # layer, by estimated cost per KV value saved (layer_plan.py)
    plan: str = option(
        "share", "What --share-ratio / --lisa-ppl-budget may do to a layer: share, drop (its attention), mixed (per layer)."
    )
    # attention dropped in these layers, besides what the plan chooses
    drop_layers: list[int] | None = option(None, "Comma-separated layers whose attention is dropped outright.")

    @property
    def ratio(self) -> float:
        return DEFAULT_SHARE_RATIO if self.share_ratio is None else self.share_ratio

    @property
    def shares_layers(self) -> bool:
        """Whether the plan changes layers: an explicit non-empty list, a search, or a ratio above 0."""
        if self.layers is not None:
            return bool(self.layers)
        return self.ppl_budget is not None or self.ratio > 0

    def validate(self) -> "LisaOptions":
        """Every range, enum and combination of LISA's options (one HfcompressError naming the first bad one)."""
        if self.share_ratio is not None and not 0.0 <= self.share_ratio < 1.0:
            raise HfcompressError(f"--share-ratio must be in [0, 1), got {self.share_ratio}.")
        given = {"--lisa-layers": self.layers, "--lisa-ppl-budget": self.ppl_budget, "--share-ratio": self.share_ratio}
        chosen_by = [name for name, value in given.items() if value is not None]
        if len(chosen_by) > 1:
            raise HfcompressError(f"{' and '.join(chosen_by)} both choose the shared layers: give only one of them.")
        if self.layers is not None and any(layer < 1 for layer in self.layers):
            raise HfcompressError(f"--lisa-layers {self.layers}: layer 0 has no layer below it to share with; give layers >= 1.")
        if self.ppl_budget is not None and not self.ppl_budget > 0:
            raise HfcompressError(f"--lisa-ppl-budget must be a percentage > 0, got {self.ppl_budget}.")
        if self.align not in ALIGN_KINDS:
            raise HfcompressError(f"Unknown --lisa-align '{self.align}': choose one of {', '.join(ALIGN_KINDS)}.")
        if self.identity_align and self.align != "sparse":
            raise HfcompressError(f"identity_align leaves a sparse Align at the identity, and align is {self.align}: use align='sparse'.")
        if self.group_heads and self.align != "sparse":  # the fit would ignore it
            raise HfcompressError(
                f"--lisa-group-heads matches heads for sparse Align, and --lisa-align is {self.align}: drop "
                "--lisa-group-heads or use --lisa-align sparse."
            )
        if self.lowrank_keys not in LOWRANK_KEYS:
            raise HfcompressError(f"Unknown --lisa-lowrank-keys '{self.lowrank_keys}': choose one of {', '.join(LOWRANK_KEYS)}.")
        at_least(self.protect_first, 0, "--protect-first")
        if self.plan not in PLAN_KINDS:
            raise HfcompressError(f"Unknown --layer-plan '{self.plan}': choose one of {', '.join(PLAN_KINDS)}.")
        if self.plan != "share" and self.layers is not None:
            raise HfcompressError(
                f"--layer-plan {self.plan} chooses the layers --share-ratio or --lisa-ppl-budget change; with --lisa-layers "
                "name the dropped ones with --drop-attention-layers."
            )
        if self.drop_layers is not None and any(layer < 1 for layer in self.drop_layers):
            raise HfcompressError(f"--drop-attention-layers {self.drop_layers}: layer 0 keeps its attention; give layers >= 1.")
        self.check_explicit_layers()
        if self.max_chain is not None:
            at_least(self.max_chain, 1, "--lisa-max-chain")
            if self.layers is not None:
                raise HfcompressError("--lisa-max-chain caps the layers --share-ratio or --lisa-ppl-budget choose; with --lisa-layers give the layers you want.")
        at_least(self.align_hidden, 0, "--align-hidden")
        at_least(self.steps, 0, "--lisa-steps")
        at_least(self.batch_size, 1, "--lisa-batch-size")
        if not self.qk_compression > 1.0:
            raise HfcompressError(f"--qk-compression must be > 1 (how many times smaller Q/K get), got {self.qk_compression}.")
        return self

    def check_explicit_layers(self) -> None:
        """Contradictions among the layers named outright (--lisa-layers, --drop-attention-layers, --protect-first),
        which need no model: a shared layer reads the attention of the layer below, so neither may be dropped."""
        shared, dropped = sorted(set(self.layers or [])), set(self.drop_layers or [])
        if both := [layer for layer in shared if layer in dropped]:
            raise HfcompressError(
                f"--lisa-layers and --drop-attention-layers both name layer {both[0]}: a layer is either shared or has "
                "its attention dropped, so name it in one of them."
            )
        if above := [layer for layer in shared if layer - 1 in dropped]:
            raise HfcompressError(
                f"--lisa-layers {above[0]} cannot be shared: it reads the attention of layer {above[0] - 1} below it, "
                f"which --drop-attention-layers drops; share another layer or keep layer {above[0] - 1}'s attention."
            )
        if protected := [layer for layer in shared if layer < self.protect_first]:
            raise HfcompressError(
                f"--lisa-layers {protected[0]} is among the {self.protect_first} shallow layers --protect-first keeps "
                f"unshared: give --protect-first {protected[0]} or less, or share deeper layers."
            )

    def check_against_model(self, config) -> None:
        """What needs the model (`config`: the family's converted view, with attention types per layer and head_dim):
        layer numbers, the layers a ratio can reach, the low-rank rank; run before calibration."""
        layers = config.num_hidden_layers
        shareable = shareable_layers(config.attention_types)
        check_drop_layers(self.drop_layers or [], layers)
        if self.layers is not None:
            check_shared_layers(self.layers, layers, shareable)
        elif self.plan != "share" and self.ppl_budget is None:
            count = round(self.ratio * layers)
            eligible = layers - max(1, self.protect_first) - len(set(self.drop_layers or []))
            if count > eligible:
                raise HfcompressError(
                    f"--share-ratio {self.ratio} asks for {count} changed layers but only {eligible} are outside the "
                    f"{self.protect_first} protected shallow layers and --drop-attention-layers: lower --share-ratio."
                )
        elif self.ppl_budget is not None:
            # a share plan changes only layers of the attention type of the layer below; a drop plan any layer
            if not any(layer >= max(1, self.protect_first) and (ok or self.plan != "share") for layer, ok in shareable.items()):
                raise HfcompressError(
                    f"--lisa-ppl-budget has no layer to search: the model's {layers} layers are all protected "
                    f"(--protect-first {self.protect_first}) or follow another attention type; lower --protect-first."
                )
        else:
            count = round(self.ratio * layers)
            eligible = [layer for layer, ok in shareable.items() if ok and layer >= max(1, self.protect_first)]
            candidates = len(eligible) if self.max_chain is None else most_with_max_chain(eligible, self.max_chain)
            if count > candidates:
                raise HfcompressError(too_few_candidates(self, count, candidates))
        if self.lowrank:
            lowrank_rank(config, self.qk_compression, self.lowrank_keys)
