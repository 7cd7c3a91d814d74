"""Qwen2 / Qwen2.5: biases on q/k/v (not o), sliding windows per layer (`layer_types`, from `use_sliding_window` and
`max_window_layers`)."""

from . import Family

FAMILY = Family(
    name="qwen2",
    title="Qwen2",
    model_types=("qwen2",),
    transformers_config="Qwen2Config",
    transformers_causal_lm="Qwen2ForCausalLM",
    converted_model_type="lisa_qwen2",
    config_module="configuration_lisa_qwen2",
    modeling_module="modeling_lisa_qwen2",
    config_class="LisaQwen2Config",
    model_class="LisaQwen2Model",
    causal_lm_class="LisaQwen2ForCausalLM",
    required_fields=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
)
