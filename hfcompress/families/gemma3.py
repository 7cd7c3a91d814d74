"""Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm with (1 + w), norms after the attention and around the
MLP, per-head q/k norms, GeGLU, tied embeddings, an explicit `head_dim` and attention scaled by
`query_pre_attn_scalar`, and sliding-window layers interleaved with full ones, each attention type with its own RoPE
base."""

from . import Family

FAMILY = Family(
    name="gemma3",
    title="Gemma 3",
    model_types=("gemma3_text",),
    transformers_config="Gemma3TextConfig",
    transformers_causal_lm="Gemma3ForCausalLM",
    required_fields=(
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "head_dim",
    ),  # fmt: skip
    gguf_architectures=("gemma3",),
)
