"""The vLLM plugin reads the one family table (the remote code's `configuration_lisa.FAMILIES`) and lays out the KV cache
from config.json alone. Runs in .venv-vllm only; no engine is started.

- `register()` gives transformers every family's converted config and vLLM every family's causal-LM architecture, and
  the model module has a class of that name for each: a new table entry is served without touching the plugin.
- A shared layer's `source` (its head matching) is read from config.json; a config without it (a model converted
  before hfcompress wrote it) is refused with one sentence naming config.json, the layers and what to do.
"""

from __future__ import annotations

import pytest

# a submodule: tests/ is on sys.path (tests/conftest.py), where this folder alone would import as a namespace "vllm"
pytest.importorskip("vllm.entrypoints.llm")

from hfcompress_vllm import register  # noqa: E402
from hfcompress_vllm.configs import CONFIG_CLASSES, FAMILIES, UnservableModel  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64)  # fmt: skip
SOURCE = [1, 0, 3, 2]  # heads of one KV group read heads of one KV group below


def test_every_family_of_the_table_is_registered():
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from hfcompress_vllm import model

    register()
    assert set(CONFIG_CLASSES) == {family.converted_model_type for family in FAMILIES.values()}
    archs = set(ModelRegistry.get_supported_archs())
    for family in FAMILIES.values():
        assert family.causal_lm_class in archs
        assert issubclass(getattr(model, family.causal_lm_class), model.LisaForCausalLM)
        config = AutoConfig.for_model(family.converted_model_type, **TINY)
        assert type(config) is CONFIG_CLASSES[family.converted_model_type] and config.lisa_family == family


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_the_cache_plan_comes_from_config_json(model_type):
    from hfcompress_vllm.model import plan_layers

    spec = {"rank": 4, "align": "sparse", "align_hidden": 0, "key_heads": 2, "source": SOURCE}
    config = CONFIG_CLASSES[model_type](**TINY, lisa_layers={"3": spec})
    plans = plan_layers(config)
    assert plans[3].kind == "shared" and plans[3].source == SOURCE and plans[3].rank == 4 and plans[3].key_heads == 2
    assert plans[2].hands_off and plans[2].layout == "grouped"


def test_a_config_without_the_cache_layout_is_refused():
    spec = {"rank": 4, "align": "sparse", "align_hidden": 0, "key_heads": 2}
    with pytest.raises(UnservableModel) as refused:
        CONFIG_CLASSES["lisa_llama"](**TINY, lisa_layers={"2": spec, "3": spec})
    message = str(refused.value)
    assert message.startswith("config.json: lisa_layers [2, 3] state no `source`") and "convert it again" in message


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_a_config_with_low_rank_values_is_refused_with_what_to_do(model_type):
    with pytest.raises(UnservableModel) as refused:
        CONFIG_CLASSES[model_type](**TINY, value_ranks={"1": 8})
    message = str(refused.value)
    assert message.startswith("config.json: value_ranks") and "--kv-plan keys" in message
