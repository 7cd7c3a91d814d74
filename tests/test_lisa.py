"""LISA layer choice (share ratio, explicit layers, perplexity-budget search) and resumable per-layer fits."""

import pytest

from hfcompress.errors import HfcompressError
from hfcompress.lisa import (
    LayerSimilarity,
    LisaOptions,
    lowrank_rank,
    most_with_max_chain,
    ranked_candidates,
    search_layers_by_perplexity,
    select_layers,
)


def similarity(errors: dict[int, float]) -> list[LayerSimilarity]:
    return [LayerSimilarity(layer, 0.3, 0.2, [0], [0.2], error) for layer, error in errors.items()]


ERRORS = {1: 0.9, 2: 0.5, 3: 0.1, 4: 0.3, 5: 0.2, 6: 0.05, 7: 0.4}


def test_ranked_candidates_skip_protected_layers_and_sort_by_aligned_error():
    assert ranked_candidates(similarity(ERRORS), LisaOptions(protect_first=2)) == [6, 3, 5, 4, 7, 2]


def test_max_chain_leaves_out_layers_that_would_lengthen_a_run():
    # ranked 6, 3, 5, 4, 7, 2: with at most 2 in a row, 4 (3-4-5-6) and 7 (5-6-7) are left out; 2 joins 3 (2-3)
    assert ranked_candidates(similarity(ERRORS), LisaOptions(protect_first=2, max_chain=2)) == [6, 3, 5, 2]
    assert ranked_candidates(similarity(ERRORS), LisaOptions(protect_first=2, max_chain=1)) == [6, 3]
    assert select_layers(similarity(ERRORS), 8, LisaOptions(share_ratio=0.5, protect_first=2, max_chain=2)) == [2, 3, 5, 6]
    with pytest.raises(HfcompressError, match="at most 1 in a row: raise --lisa-max-chain"):
        select_layers(similarity(ERRORS), 8, LisaOptions(share_ratio=0.5, protect_first=2, max_chain=1))
    assert most_with_max_chain([2, 3, 4, 5, 6, 7], 1) == 3 and most_with_max_chain([2, 3, 4, 5, 6, 7], 2) == 4
    assert most_with_max_chain([2, 3, 5, 6, 7, 9], 2) == 5 and most_with_max_chain([], 3) == 0


def test_share_ratio_and_explicit_layers():
    assert select_layers(similarity(ERRORS), 8, LisaOptions(share_ratio=0.25, protect_first=2)) == [3, 6]
    assert select_layers(similarity(ERRORS), 8, LisaOptions(layers=[5, 2, 5])) == [2, 5]
    with pytest.raises(HfcompressError, match="out of range"):
        select_layers(similarity(ERRORS), 8, LisaOptions(layers=[0]))


@pytest.mark.parametrize("limit, expected", [(10.0, []), (10.5, [6]), (12.2, [3, 4, 5, 6]), (99.0, [2, 3, 4, 5, 6, 7])])
def test_perplexity_search_takes_the_most_layers_within_budget(limit, expected):
    ranked = [6, 3, 5, 4, 7, 2]
    calls = []

    def perplexity_of(layers):  # each shared layer costs +0.5 perplexity
        calls.append(layers)
        return 10.0 + 0.5 * len(layers)

    chosen, probes = search_layers_by_perplexity(ranked, perplexity_of, limit)
    assert chosen == expected
    assert len(calls) <= 3  # log2(6 + 1) probes, not one per count
    assert all(p["within_budget"] == (p["perplexity"] <= limit) for p in probes)
    assert all(p["layers"] == sorted(ranked[: p["count"]]) for p in probes)


def tiny_converted_llama(num_layers: int):
    """A random tiny Llama in the converted classes (4 heads, 2 KV heads, head_dim 8), 8 random attention inputs of 16
    tokens, and the RoPE of those positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfcompress.lisa import rotary
    from hfcompress.conversion.build import in_converted_classes

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = in_converted_classes(LlamaForCausalLM(config).eval())
    x = torch.randn(8, 16, 32) * 0.3
    return model, x, rotary(model, x[:1], 1)


def test_fit_is_invariant_to_the_input_scale():
    """Adam's step has a fixed size in weight space, so a low-rank Q/K fit at one rate would move 10x larger inputs'
    scores 10x faster (Gemma 3's attention inputs are 4-10x SmolLM2's, and diverged): the fit scales the low-rank
    weights' initial size and rate by the input's RMS. The same layer on 10x inputs (its Q/K/V weights / 10, so the
    same scores and targets) must fit to the same loss."""
    import copy

    import torch

    from hfcompress.lisa import fit_shared_layer, full_attention_scores

    model, x, cos_sin = tiny_converted_llama(num_layers=2)
    below, attn = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    with torch.no_grad():
        prev_scores = full_attention_scores(below, x, cos_sin)
        scaled = copy.deepcopy(attn)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(scaled, name).weight.div_(10)
    options = LisaOptions(steps=10, batch_size=4)
    fits = [fit_shared_layer(model.config, module, cos_sin, 1, inputs, prev_scores, [0, 1, 2, 3], 4, options)[1]
            for module, inputs in ((attn, x), (scaled, 10 * x))]
    assert fits[0].loss_initial == pytest.approx(fits[1].loss_initial, rel=1e-4)
    assert fits[0].loss_final == pytest.approx(fits[1].loss_final, abs=1e-3 * fits[0].loss_initial)
    assert fits[0].loss_final < 0.9 * fits[0].loss_initial


def test_grouped_low_rank_keys_buy_a_higher_rank_at_the_same_compression():
    """SmolLM2's shape (hidden 576, 9 heads, 3 KV heads, head_dim 64; W_Q + W_K = 576 x 768): at 6x, one low-rank key
    per head gives rank 6 (2 x 9 x 6 = 108 outputs), one per KV group rank 10 (9 x 10 + 3 x 10 = 120 <= 128)."""
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=576, head_dim=64, num_attention_heads=9, num_key_value_heads=3)
    assert lowrank_rank(config, 6.0) == lowrank_rank(config, 6.0, "head") == 6
    assert lowrank_rank(config, 6.0, "group") == 10


@pytest.mark.parametrize("lowrank_keys", ["head", "group"])
def test_sparse_fits_read_the_features_below_and_fit_as_from_its_scores(lowrank_keys):
    """A sparse Align's scores are linear in the layer below's (scaled query, key) features, so a chain of shared
    layers is fitted from those (N x H x T x (D + r)) instead of the N x H x T x T scores: the scores they give are
    the scores, and a fit from features matches a fit from the same scores."""
    import torch

    from hfcompress.lisa import fit_shared_layer, handed_over, scores_of

    model, x, cos_sin = tiny_converted_llama(num_layers=3)
    layers = model.model.layers
    options = LisaOptions(steps=10, batch_size=4, lowrank_keys=lowrank_keys)
    dense_handoff = LisaOptions(steps=10, batch_size=4, align="dense")  # the same layers handing scores
    features = handed_over(layers[0].self_attn, x, None, cos_sin, options)
    scores = handed_over(layers[0].self_attn, x, None, cos_sin, dense_handoff)
    assert isinstance(features, tuple) and features[0].shape[-1] == 8 and features[1].shape[1] == 2  # KV heads: no copy
    torch.testing.assert_close(scores_of(features), scores, atol=1e-5, rtol=1e-5)

    fits = [fit_shared_layer(model.config, layers[1].self_attn, cos_sin, 1, x, below, [1, 0, 3, 2], 4, options)
            for below in (features, scores)]
    assert fits[0][1].loss_initial == pytest.approx(fits[1][1].loss_initial, rel=1e-4)
    assert fits[0][1].loss_final == pytest.approx(fits[1][1].loss_final, rel=1e-3)
    module = fits[0][0]
    passed = handed_over(module, x, features, cos_sin, options)  # layer 2 of a chain reads the shared layer 1
    assert passed[0].shape[-1] == 8 + 4 and passed[1].shape[1] == 4  # keys re-ordered to this layer's heads
    positions = torch.arange(16).unsqueeze(0).expand(8, -1)
    expected = module.scores(scores, *module.lowrank_qk(x, positions))
    torch.testing.assert_close(scores_of(passed), expected, atol=1e-5, rtol=1e-5)


def test_fits_read_only_the_sequences_their_draws_can_reach():
    """A fit of `steps x batch_size` draws reads the first that many calibration sequences (at least the report's 16),
    so a larger calibration costs LISA no memory: sequences beyond them are never read (NaN there changes nothing),
    and with fewer sequences than that the fit reads them all."""
    import torch

    from research.inmemory import fit_lisa, measure_similarity

    model, _, _ = tiny_converted_llama(num_layers=4)
    torch.manual_seed(1)
    inputs = [torch.randn(24, 16, 32) * 0.3 for _ in range(4)]
    similarity = measure_similarity(model, inputs)
    options = LisaOptions(steps=8, batch_size=2)  # 16 draws: the first 16 of 24 sequences
    poisoned = [torch.cat([t[:16], torch.full_like(t[16:], float("nan"))]) for t in inputs]
    fits = [fit_lisa(model, x, [2, 3], similarity, options) for x in (inputs, poisoned, [t[:16] for t in inputs])]
    for a, b, c in zip(*fits):
        assert all(torch.isfinite(v).all() for v in a.state.values())
        assert all(torch.equal(a.state[k], b.state[k]) and torch.equal(a.state[k], c.state[k]) for k in a.state)
    everything = LisaOptions(steps=8, batch_size=4)  # 32 draws reach all 24
    assert not all(torch.equal(a.state[k], b.state[k]) for a, b in zip(
        fit_lisa(model, inputs, [2, 3], similarity, everything), fit_lisa(model, poisoned, [2, 3], similarity, everything)
    ) for k in a.state)
