"""Qwen2 / Qwen2.5: biases on q/k/v (not o), sliding windows per layer (`layer_types`, from `use_sliding_window` and
`max_window_layers`)."""

from . import Family

FAMILY = Family(
    name="qwen2",
    title="Qwen2",
    model_types=("qwen2",),
    transformers_config="Qwen2Config",
    transformers_causal_lm="Qwen2ForCausalLM",
    required_fields=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
)
