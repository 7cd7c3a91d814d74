"""Rank arithmetic of a shared layer's low-rank Q/K: how many low-rank key heads it has, and the largest even rank
that keeps its Q/K parameters --qk-compression times smaller than the original's W_Q + W_K."""

from ..errors import HfcompressError

LOWRANK_KEYS = ("head", "group")


def lowrank_key_heads(config, lowrank_keys: str) -> int:
    """Low-rank key heads of a shared layer: one per attention head, or one per KV group."""
    return config.num_attention_heads if lowrank_keys == "head" else config.num_key_value_heads


def lowrank_rank(config, qk_compression: float, lowrank_keys: str = "head") -> int:
    """Largest even rank r whose low-rank Q/K (d * (H + key heads) * r) is >= qk_compression x smaller than W_Q+W_K
    (with one key per KV group, the same parameters buy a higher rank)."""
    dense = config.hidden_size * config.head_dim * (config.num_attention_heads + config.num_key_value_heads)
    heads = config.num_attention_heads + lowrank_key_heads(config, lowrank_keys)
    rank = int(dense / qk_compression / (config.hidden_size * heads))
    rank -= rank % 2
    if rank < 2:
        raise HfcompressError(f"--qk-compression {qk_compression} leaves no room for a rank-2 low-rank Q/K.")
    return rank
