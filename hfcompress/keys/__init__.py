"""Low-rank keys: every attention layer's keys through a rank-limited map chosen by a loss-aware criterion (issue 41).

    statistics.py  the key statistics of a whole model on calibration tokens: C = E[k k^T], G = E[g g^T], queries' energy
    subspace.py    the arithmetic: the two layouts (pre-RoPE, RoPE-commuting), the four criteria, the per-layer budget
    options.py     KeyOptions: --kv-budget, --kv-plan
    method.py      KeysMethod: the conversion's unit (statistics streamed layer by layer, the plan, the factors);
                   with --kv-plan keys-values the values get a latent too, by the same arithmetic
    joint.py       the joint plan's exact per-layer choice (keep, a key latent width, drop) within the budget

The remote code's layer actions are `key_ranks` and `value_ranks` (modeling/lisa_attention.py); the peers step uses the
statistics on transformers' model (the training-free PCA of the keys at the conversion's saving), and
benchmarks/key_compression.py and value_compression.py measure the layouts and criteria.
"""

from .method import KeysMethod
from .options import KeyOptions
from .statistics import KeyStatistics, key_module, key_statistics, projected_keys, projected_values
from .subspace import CRITERIA, LAYOUTS, KeySubspace, plan_sizes, rope_planes

__all__ = [
    "CRITERIA", "LAYOUTS", "KeyOptions", "KeyStatistics", "KeySubspace", "KeysMethod", "key_module", "key_statistics",
    "plan_sizes", "projected_keys", "projected_values", "rope_planes",
]  # fmt: skip
