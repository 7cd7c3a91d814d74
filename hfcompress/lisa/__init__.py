"""LISA: share a layer's attention with the layer below it (Align of the layer below's scores + a low-rank Q/K term).

    options.py     LisaOptions: every option's default, help, range checks and check against the model
    attention.py   attention primitives (RoPE per layer, causal mask, scores, output) the others share
    similarity.py  cross-layer attention similarity (JS divergence, head matching, aligned output error)
    selection.py   which layers to share: ratio, explicit list, perplexity search; their checks
    rank.py        the low-rank Q/K's rank from --qk-compression
    handoff.py     what a converted layer hands the shared layer above it
    fit.py         the local fit of one shared layer
    weights.py     a shared layer's tensors in a layer's state dict (fit record, parameter names, q/k replaced)
    method.py      LisaMethod, the pipeline unit

The in-memory driver of the research scripts (measure_similarity, fit_lisa on a loaded model) is research/inmemory.py,
outside the package.
"""

from .attention import attention_output, causal_mask, full_attention_scores, relative_error, rotary
from .fit import FIT_REPORT_SEQUENCES, LOWRANK_INPUT_RMS, fit_inputs, fit_shared_layer, shared_attention
from .handoff import Below, handed_over, hands_features, rows, scores_of
from .method import LisaMethod
from .options import ALIGN_KINDS, DEFAULT_SHARE_RATIO, SELECTION_ONLY, SHOWN_SHARE_RATIO, LisaOptions
from .rank import LOWRANK_KEYS, lowrank_key_heads, lowrank_rank
from .selection import (
    check_attention_types, check_drop_layers, check_shared_layers, most_with_max_chain, ranked_candidates,
    search_layers_by_perplexity, select_layers, shareable_layers, too_few_candidates,
)  # fmt: skip
from .similarity import (
    SIMILARITY_SEQUENCES, LayerSimilarity, alignment_mix, attention_energy, group_matching, js_matrix, layer_similarity,
)  # fmt: skip
from .weights import (
    PARAMETER_MARKERS, REPLACED, FittedLayer, is_lisa_parameter, replace_qk, shared_qk_parameters, without_attention,
)  # fmt: skip

__all__ = [
    "ALIGN_KINDS", "DEFAULT_SHARE_RATIO", "FIT_REPORT_SEQUENCES", "LOWRANK_INPUT_RMS", "LOWRANK_KEYS", "PARAMETER_MARKERS",
    "REPLACED", "SELECTION_ONLY", "SHOWN_SHARE_RATIO", "SIMILARITY_SEQUENCES", "Below", "FittedLayer", "LayerSimilarity",
    "LisaMethod", "LisaOptions", "alignment_mix", "attention_energy", "attention_output", "causal_mask", "check_attention_types",
    "check_drop_layers", "check_shared_layers", "fit_inputs", "fit_shared_layer", "full_attention_scores",
    "group_matching", "handed_over", "hands_features", "is_lisa_parameter", "js_matrix", "layer_similarity",
    "lowrank_key_heads", "lowrank_rank", "most_with_max_chain", "ranked_candidates", "relative_error", "replace_qk",
    "rows", "scores_of", "search_layers_by_perplexity", "select_layers", "shareable_layers",
    "shared_attention", "shared_qk_parameters", "too_few_candidates", "without_attention",
]  # fmt: skip
