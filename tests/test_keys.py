"""hfcompress.keys: the low-rank keys' arithmetic (layouts, criteria, budget) and its statistics on a real forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hfcompress.keys import KeyStatistics, KeySubspace, key_statistics, plan_sizes, projected_keys

KV, D, HEADS = 3, 16, 9  # GQA 9:3 as SmolLM2, narrow heads


def random_stats(seed: int, scale: float = 1.0) -> KeyStatistics:
    """Second moments of correlated random keys / gradients / queries (not isotropic, so the criteria differ)."""
    g = torch.Generator().manual_seed(seed)
    width = KV * D
    mix = torch.randn(width, width, generator=g, dtype=torch.float64) * torch.linspace(3, 0.1, width, dtype=torch.float64)
    keys = torch.randn(4096, width, generator=g, dtype=torch.float64) @ mix
    grads = torch.randn(4096, width, generator=g, dtype=torch.float64) @ torch.randn(width, width, generator=g, dtype=torch.float64)
    queries = torch.randn(4096, HEADS * D, generator=g, dtype=torch.float64) * torch.rand(HEADS * D, generator=g, dtype=torch.float64)
    return KeyStatistics(keys.T @ keys / 4096, queries.pow(2).mean(0), scale * grads.T @ grads / 4096, 4096)


@pytest.mark.parametrize("criterion", ["svd", "pca", "query", "fisher"])
def test_rope_layout_commutes_with_rope_and_pre_layout_does_not(criterion):
    stats = random_stats(0)
    weight = torch.randn(KV * D, 64, dtype=torch.float64)
    config = type("C", (), {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "head_dim": D,
                            "hidden_size": D * HEADS, "num_attention_heads": HEADS, "max_position_embeddings": 4096})()
    rotary = LlamaRotaryEmbedding(config)
    keys = torch.randn(1, 5, KV * D, dtype=torch.float64)
    cos, sin = rotary(keys.float(), torch.tensor([[0, 7, 100, 513, 2000]]))

    def rope(flat: torch.Tensor) -> torch.Tensor:  # (1, T, KV*d) -> RoPE per KV head, back to (1, T, KV*d)
        heads = flat.reshape(1, 5, KV, D).transpose(1, 2)
        rotated, _ = apply_rotary_pos_emb(heads, heads, cos.double(), sin.double())
        return rotated.transpose(1, 2).reshape(1, 5, KV * D)

    for layout, commutes in (("rope", True), ("pre", False)):
        sub = KeySubspace(stats, weight, criterion, layout, D)
        p = sub.projector(sub.max_size // 2)
        after, before = rope(keys) @ p.T, rope(keys @ p.T)
        assert torch.allclose(after, before, atol=1e-9) == commutes, layout
        assert torch.linalg.matrix_rank(p).item() == sub.max_size // 2 * sub.values_per_step
        assert torch.allclose(sub.projector(sub.max_size), torch.eye(KV * D, dtype=torch.float64), atol=1e-6)


def test_fisher_criterion_has_the_lowest_surrogate_and_costs_fall_with_rank():
    stats = random_stats(1)
    weight = torch.randn(KV * D, 64, dtype=torch.float64)
    subs = {c: KeySubspace(stats, weight, c, "pre", D) for c in ("svd", "pca", "query", "fisher")}
    for n in (4, 12, 24, 40):
        fisher = subs["fisher"].cost(n)
        for name, sub in subs.items():
            assert fisher <= sub.cost(n) * (1 + 1e-9), (name, n)
    costs = [subs["fisher"].cost(n) for n in range(0, KV * D + 1, 8)]
    assert costs == sorted(costs, reverse=True) and costs[-1] == pytest.approx(0, abs=1e-6 * costs[0])
    with pytest.raises(ValueError, match="gradient"):
        KeySubspace(KeyStatistics(stats.C, stats.q2), weight, "fisher", "pre", D)


def test_plan_spends_the_budget_where_the_loss_is():
    weight = torch.randn(KV * D, 64, dtype=torch.float64)
    subs = [KeySubspace(random_stats(2, scale), weight, "fisher", layout, D) for scale, layout in ((1.0, "pre"), (100.0, "pre"))]
    sizes = plan_sizes(subs, 40)
    assert sum(sizes) == 40 and sizes[1] > sizes[0]  # the layer whose keys the loss is 100x more sensitive to
    rope = [KeySubspace(random_stats(3), weight, "pca", "rope", D) for _ in range(2)]
    sizes = plan_sizes(rope, 41)  # complex dimensions cost two values: 41 values buy 20 of them
    assert sum(sizes) == 20


def test_key_statistics_and_projection_on_a_real_forward(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    sequences = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = key_statistics(model, sequences, gradients=True)
    layer = model.model.layers[1].self_attn
    with torch.no_grad():
        hidden = model(sequences, output_hidden_states=True).hidden_states[1]
        keys = layer.k_proj(model.model.layers[1].input_layernorm(hidden)).reshape(-1, layer.k_proj.out_features).double()
    assert torch.allclose(stats[1].C, keys.T @ keys / keys.shape[0], rtol=1e-5, atol=1e-8)
    assert stats[1].G.diagonal().min() > 0 and stats[1].tokens == sequences.numel()
    assert all(p.requires_grad for p in model.parameters())  # restored after the gradient pass
    with torch.no_grad():
        reference = model(sequences).logits
        width = layer.k_proj.out_features
        with projected_keys(model, {l: torch.eye(width) for l in range(4)}):
            assert torch.allclose(model(sequences).logits, reference, atol=1e-5)
        head_dim = width // model.config.num_key_value_heads
        sub = KeySubspace(stats[1], layer.k_proj.weight, "fisher", "rope", head_dim)
        with projected_keys(model, {1: sub.projector(1).float()}):
            assert not torch.allclose(model(sequences).logits, reference, atol=1e-3)
        assert torch.allclose(model(sequences).logits, reference)  # the hooks are gone
