"""The vLLM plugin reads the one family table (the remote code's `configuration_lisa.FAMILIES`) and lays out the KV cache
from config.json alone. Runs in .venv-vllm only; no engine is started.

- `register()` gives transformers every family's converted config and vLLM every family's causal-LM architecture, and
  the model module has a class of that name for each: a new table entry is served without touching the plugin.
- A shared layer's `source` (its head matching) is read from config.json; a config without it (a model converted
  before hfcompress wrote it) is refused with one sentence naming config.json, the layers and what to do.
- Low-rank values (`value_ranks`) are served: their layers are planned in the latent layout.
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
def test_low_rank_values_are_planned_as_latent_caches(model_type):
    """`value_ranks` (hfcompress --kv-plan keys-values) is served: a layer with a value latent caches it (head_size_v =
    ceil(r / KV)), beside its key latent (head_size = ceil(r / KV)) or its rotated keys (head_size = d); as the root of a
    shared layer it hands its keys; without the latent layout (HFCOMPRESS_VLLM_KEYS=full, GPU platforms) its values
    are rebuilt to full width. A value latent on a shared layer stays refused (the remote config's own check)."""
    from hfcompress_vllm.model import describe, plan_layers

    spec = {"rank": 4, "align": "sparse", "align_hidden": 0, "key_heads": 2, "source": SOURCE}
    config = CONFIG_CLASSES[model_type](**TINY, lisa_layers={"3": spec}, key_ranks={"0": 20}, value_ranks={"0": 9, "2": 31})
    d = config.head_dim
    plans = plan_layers(config, lowrank=True, latent=True)
    assert (plans[0].layout, plans[0].head_size, plans[0].value_size) == ("latent", 10, 5)
    assert (plans[2].layout, plans[2].head_size, plans[2].value_size, plans[2].hands_off) == ("latent", d, 16, True)
    assert plans[1].layout == "plain" and plans[3].layout == "lowrank"
    assert describe(plans)[2] == f"latent (keys 2 x {d} (handed to the shared layers above), values rank 31: 2 x 16)"
    full = describe(plan_layers(config, lowrank=True))
    assert full[0] == "plain (key latent 20 rebuilt to full-width keys, value latent 9 rebuilt to full-width values)"
    assert full[2] == "plain (value latent 31 rebuilt to full-width values)"
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="both a LISA layer and a low-rank value layer"):
        CONFIG_CLASSES[model_type](**TINY, lisa_layers={"3": spec}, value_ranks={"3": 8})
