"""Mistral: Llama's layout without biases, an explicit `head_dim`, and a `sliding_window` (None: full attention) that
every layer applies."""

from . import Family

FAMILY = Family(
    name="mistral",
    title="Mistral",
    model_types=("mistral",),
    transformers_config="MistralConfig",
    transformers_causal_lm="MistralForCausalLM",
    required_fields=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
)
