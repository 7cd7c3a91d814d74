"""LisaLlamaForCausalLM against transformers' LlamaForCausalLM on a tiny random model."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfcompress.families import FAMILIES

LisaLlamaConfig, LisaLlamaForCausalLM = FAMILIES["llama"].remote_classes()


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256,
    )
    return LlamaConfig(**{**base, **overrides})


def lisa_copy(reference: LlamaForCausalLM, **spec) -> LisaLlamaForCausalLM:
    config = LisaLlamaConfig(**{k: v for k, v in reference.config.to_dict().items() if k != "model_type"}, **spec)
    model = LisaLlamaForCausalLM(config).eval()
    state = {k: v for k, v in reference.state_dict().items()}
    for layer in config.lisa_layers:
        for proj in ("q_proj", "k_proj"):
            state.pop(f"model.layers.{layer}.self_attn.{proj}.weight")
    for name, rank in config.fasc_ranks.items():
        weight = state.pop(f"model.layers.{name}.weight")
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        state[f"model.layers.{name}.proj_out.weight"] = u[:, :rank] * s[:rank]
        state[f"model.layers.{name}.proj_in.weight"] = vh[:rank]
    missing = model.load_state_dict(state, strict=False).missing_keys
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in missing and "lm_head" not in name:  # LISA modules: random but non-trivial
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.tie_weights()
    return model


def random_lisa_model(config: LlamaConfig, **spec) -> LisaLlamaForCausalLM:
    """`lisa_copy` of a random Llama (seed 0): random LISA modules, sparse layers reading permuted source heads with
    random scales."""
    torch.manual_seed(0)
    model = lisa_copy(LlamaForCausalLM(config).eval(), **spec)
    generator = torch.Generator().manual_seed(3)
    heads = config.num_attention_heads
    for layer in model.model.layers:
        if layer.is_lisa and layer.self_attn.sparse:
            layer.self_attn.align.source.copy_(torch.randperm(heads, generator=generator))
            layer.self_attn.align.scale.data = 0.5 + torch.rand(heads, generator=generator)
    return model


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_no_layer_converted_matches_llama(kv_heads):
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config(num_key_value_heads=kv_heads)).eval()
    model = lisa_copy(reference)
    ids = torch.randint(0, 128, (2, 17))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= 1e-4


def test_fasc_full_rank_matches_llama():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference, fasc_ranks={"1.mlp.down_proj": 64, "2.self_attn.o_proj": 64})
    assert type(model.model.layers[1].mlp.down_proj).__name__ == "FascLinear"
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= 1e-4


def test_lisa_generate_with_cache_equals_recompute():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference, lisa_layers={"2": {"rank": 4, "align": "dense", "align_hidden": 8}, "3": {"rank": 4, "align": "dense", "align_hidden": 0}})
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        sequence = ids
        for _ in range(12):
            step = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step], dim=1)
    assert torch.equal(generated, sequence)


def test_lisa_layer_caches_only_lowrank_k_and_v():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference, lisa_layers={"2": {"rank": 4, "align": "dense", "align_hidden": 0}})
    with torch.no_grad():
        cache = model(torch.randint(0, 128, (1, 5)), use_cache=True).cache
    full, shared = cache.layers[1], cache.layers[2]
    assert full.keys.shape == (1, 2, 5, 16)
    assert shared.keys.shape == (1, 4, 5, 4)  # H heads x rank r, not kv_heads x head_dim
    assert shared.values.shape == (1, 2, 5, 16)
    assert not hasattr(model.model.layers[2].self_attn, "q_proj")


def test_left_padding_does_not_change_logits():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference, lisa_layers={"1": {"rank": 4, "align": "dense", "align_hidden": 4}})
    ids = torch.randint(0, 128, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(ids).logits
        with_pad = model(padded, attention_mask=mask).logits[:, 3:]
    assert (plain - with_pad).abs().max() <= 1e-4


def test_config_rejects_bad_lisa_spec():
    with pytest.raises(Exception, match="layer 0 has no anchor"):
        LisaLlamaConfig(**tiny_config().to_dict() | {"lisa_layers": {"0": {"rank": 4}}})
    with pytest.raises(Exception, match="even"):
        LisaLlamaConfig(**tiny_config().to_dict() | {"lisa_layers": {"1": {"rank": 3}}})


SPARSE_CHAINS = {
    "sparse after full": {"2": {"rank": 4, "align": "sparse"}},
    "sparse chain": {"1": {"rank": 4, "align": "sparse"}, "2": {"rank": 4, "align": "sparse"}},
    "sparse, dense, sparse": {  # a sparse layer above a dense one receives materialised scores
        "1": {"rank": 4, "align": "sparse"}, "2": {"rank": 4, "align": "dense", "align_hidden": 4}, "3": {"rank": 2, "align": "sparse"},
    },
    "sparse at rank 0": {"2": {"rank": 0, "align": "sparse"}},
}


def sparse_model(spec: dict) -> tuple[LlamaForCausalLM, LisaLlamaForCausalLM]:
    """(reference Llama, LisaLlama copy with `spec`) where sparse layers have a non-trivial head matching, as
    conversion would set it."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference, lisa_layers=spec)
    for layer in model.model.layers:
        if layer.is_lisa and layer.self_attn.sparse:
            layer.self_attn.align.source.copy_(torch.tensor([2, 0, 3, 3]))
    return reference, model


@pytest.mark.parametrize("spec", SPARSE_CHAINS.values(), ids=SPARSE_CHAINS.keys())
def test_sparse_align_features_path_equals_materialised_scores(spec):
    """The SDPA path over concatenated features computes exactly Align(S_prev) + low-rank scores."""
    reference, model = sparse_model(spec)
    ids = torch.randint(0, 128, (2, 13))
    materialised = lisa_copy(reference, lisa_layers=spec)
    materialised.load_state_dict(model.state_dict())
    materialised.model.handoffs = ["scores" if h else None for h in materialised.model.handoffs]
    assert "features" in model.model.handoffs
    with torch.no_grad():
        assert (model(ids).logits - materialised(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("spec", SPARSE_CHAINS.values(), ids=SPARSE_CHAINS.keys())
def test_sparse_align_generate_with_cache_equals_recompute(spec):
    _, model = sparse_model(spec)
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        sequence = ids
        for _ in range(10):
            sequence = torch.cat([sequence, model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, sequence)


def test_sparse_align_source_heads_survive_save_and_load(tmp_path):
    _, model = sparse_model({"2": {"rank": 4, "align": "sparse"}})
    model.save_pretrained(tmp_path)
    loaded = LisaLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.layers[2].self_attn.align.source.tolist() == [2, 0, 3, 3]
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max() <= 1e-5


def test_sampling_with_cache_equals_sampling_without():
    """generate(do_sample=True) draws the same tokens with and without the cache under one seed."""
    torch.manual_seed(0)
    model = lisa_copy(
        LlamaForCausalLM(tiny_config()).eval(),
        lisa_layers={"1": {"rank": 4, "align": "sparse"}, "2": {"rank": 4, "align": "dense", "align_hidden": 4}},
    )
    ids = torch.randint(0, 128, (2, 5))
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        with torch.no_grad():
            runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=True,
                                       top_k=20, temperature=0.9, use_cache=use_cache))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, 15)
