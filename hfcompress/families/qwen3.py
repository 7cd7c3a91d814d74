"""Qwen3: per-head RMSNorm on q and k before RoPE, an explicit `head_dim`, biases per `attention_bias`, sliding
windows per layer as Qwen2."""

from . import Family

FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    model_types=("qwen3",),
    transformers_config="Qwen3Config",
    transformers_causal_lm="Qwen3ForCausalLM",
    required_fields=(
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "head_dim",
    ),  # fmt: skip
)
