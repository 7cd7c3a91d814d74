"""Llama (and every source llama.cpp and transformers read as Llama, e.g. SmolLM2): full attention in every layer,
biases per `attention_bias`."""

from . import Family

FAMILY = Family(
    name="llama",
    title="Llama",
    model_types=("llama",),
    transformers_config="LlamaConfig",
    transformers_causal_lm="LlamaForCausalLM",
    required_fields=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    gguf_architectures=("llama",),
)
