"""Mistral: Llama's layout without biases, an explicit `head_dim`, and a `sliding_window` (None: full attention) that
every layer applies."""

from . import Family

FAMILY = Family(
    name="mistral",
    title="Mistral",
    model_types=("mistral",),
    transformers_config="MistralConfig",
    transformers_causal_lm="MistralForCausalLM",
    converted_model_type="lisa_mistral",
    config_module="configuration_lisa_mistral",
    modeling_module="modeling_lisa_mistral",
    config_class="LisaMistralConfig",
    model_class="LisaMistralModel",
    causal_lm_class="LisaMistralForCausalLM",
    required_fields=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
)
