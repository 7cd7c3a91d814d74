"""LisaLlamaForCausalLM behaves like any transformers causal LM: static caches, torch.compile, gradient checkpointing,
output_hidden_states / output_attentions, return_dict=False, batched generation with left padding (issue 14)."""

import pytest
import torch
from test_modeling import lisa_copy, random_lisa_model, tiny_config
from test_shared_paths import eager_logits, left_padded
from transformers import LlamaForCausalLM, StaticCache

from hfcompress.remote import import_remote

modeling = import_remote("modeling_lisa_llama")
lisa_attention = import_remote("lisa_attention")

# (lisa_layers, fasc_ranks) of a 4-layer model; what each LISA layer receives from the one below is in the name
SPECS = {
    "dense": ({"2": {"rank": 4, "align": "dense", "align_hidden": 8}}, {}),  # features from a full layer, block-wise
    "sparse": ({"2": {"rank": 4, "align": "sparse"}}, {}),  # features from a full layer, one SDPA call
    "sparse then dense": ({"2": {"rank": 4, "align": "sparse"}, "3": {"rank": 2, "align": "dense", "align_hidden": 4}}, {}),
    "dense chain, rank 0": (  # scores from a dense layer, to a dense and to a sparse one
        {"1": {"rank": 4, "align": "dense", "align_hidden": 4}, "2": {"rank": 0, "align": "dense", "align_hidden": 4}, "3": {"rank": 0, "align": "sparse"}},
        {},
    ),
    "sparse chain, FASC": (
        {"2": {"rank": 4, "align": "sparse"}, "3": {"rank": 4, "align": "sparse"}},
        {"1.mlp.down_proj": 32, "2.self_attn.v_proj": 16, "3.self_attn.o_proj": 32},
    ),
}  # fmt: skip
NEW_TOKENS = 6


def converted(name: str) -> torch.nn.Module:
    """A converted tiny model: random LISA modules, sparse layers reading permuted source heads with random scales."""
    lisa_layers, fasc_ranks = SPECS[name]
    return random_lisa_model(tiny_config(), lisa_layers=lisa_layers, fasc_ranks=fasc_ranks)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens (B, N), logits of each step (B, N, vocab)) of greedy generation: a random tiny model's tokens barely
    react to its attention, its logits do."""
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, **kwargs,
    )  # fmt: skip
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


def assert_same_generation(actual: tuple, expected: tuple, what: str = "") -> None:
    assert torch.equal(actual[0], expected[0]), what
    torch.testing.assert_close(actual[1], expected[1], atol=1e-4, rtol=1e-4, msg=what)


@pytest.mark.parametrize("padding", ["no padding", "left padding"])
@pytest.mark.parametrize("name", SPECS)
def test_static_cache_generates_what_the_dynamic_cache_does(name, padding):
    model = converted(name)
    ids, mask = left_padded([7, 7] if padding == "no padding" else [7, 3], 7)
    assert_same_generation(greedy(model, ids, mask, cache_implementation="static"), greedy(model, ids, mask))


@pytest.mark.parametrize("name", SPECS)
def test_left_padded_batch_generates_what_each_prompt_alone_does(name):
    model = converted(name)
    lengths, total = [7, 4, 2], 7
    ids, mask = left_padded(lengths, total)
    tokens, logits = greedy(model, ids, mask, cache_implementation="static")
    for row, length in enumerate(lengths):
        alone = greedy(model, ids[row : row + 1, total - length :], mask[row : row + 1, total - length :])
        assert_same_generation((tokens[row : row + 1], logits[row : row + 1]), alone, f"prompt {row} ({length} tokens)")


def test_static_cache_allocates_lisa_layers_at_their_own_shapes():
    """Full layers: K and V on the KV heads; a LISA layer: low-rank K on all heads (H x r), V on the KV heads. Early
    initialisation (chunked prefill in generate) sizes the full layers only: the LISA layers wait for their first
    update."""
    model = converted("sparse then dense")
    cache = StaticCache(config=model.config, max_cache_len=10)
    cache.early_initialization(batch_size=2, num_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    assert [layer.is_initialized for layer in cache.layers] == [True, True, False, False]
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 6)), cache=cache)
    shapes = [(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers]
    full, lisa = ((2, 2, 10, 16), (2, 2, 10, 16)), [((2, 4, 10, 4), (2, 2, 10, 16)), ((2, 4, 10, 2), (2, 2, 10, 16))]
    assert shapes == [full, full, *lisa]
    ids, mask = left_padded([7, 3], 7)
    chunked = greedy(model, ids, mask, cache_implementation="static", prefill_chunk_size=3)
    assert_same_generation(chunked, greedy(model, ids, mask))


def test_compiled_forward_and_static_cache_decode_step_equal_eager():
    """fullgraph=True: any graph break is an error, so dynamo traces the whole forward (aot_eager: through AOT
    autograd, without inductor's compile time)."""
    assert modeling.LisaLlamaForCausalLM._can_compile_fullgraph
    model = converted("sparse then dense")
    ids, mask = left_padded([8, 5], 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        prefill = compiled(ids, attention_mask=mask).logits
        torch.testing.assert_close(prefill, model(ids, attention_mask=mask).logits, atol=1e-4, rtol=0)
        caches = [StaticCache(config=model.config, max_cache_len=12) for _ in range(2)]
        for cache in caches:
            model(ids, attention_mask=mask, cache=cache)
        step = {
            "input_ids": prefill[:, -1:].argmax(-1),
            "attention_mask": torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
            "position_ids": torch.full((2, 1), 8),
        }
        decoded = compiled(**step, cache=caches[0]).logits
        torch.testing.assert_close(decoded, model(**step, cache=caches[1]).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["sparse then dense", "dense chain, rank 0", "sparse chain, FASC"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_every_gradient(name):
    """The scores and features a LISA layer reads from the layer below carry gradient into it: checkpointed, every
    trainable parameter gets exactly the gradient it gets without checkpointing."""
    model = converted(name).train()
    ids, mask = left_padded([9, 6], 9)
    labels = ids.masked_fill(mask == 0, -100)
    runs = []
    for layer in model.model.layers:  # the recompute stops after the last saved tensor: count the layers' first module
        layer.input_layernorm.register_forward_hook(lambda *args: runs.append(1))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        runs.clear()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    assert len(runs) == 4
    model.gradient_checkpointing_enable()
    checkpointed = gradients()
    assert len(runs) == 8  # every layer ran again in the backward pass
    assert set(plain) == set(checkpointed) == {n for n, p in model.named_parameters() if p.numel()}  # rank 0: empty Q/K
    for param in plain:
        torch.testing.assert_close(checkpointed[param], plain[param], atol=1e-6, rtol=1e-5, msg=param)


def test_reentrant_gradient_checkpointing_is_refused():
    model = converted("sparse then dense")
    with pytest.raises(ValueError, match="non-reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def test_hidden_states_follow_llama():
    """num_layers + 1 states: the embeddings first, the last one after the final norm."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    ids, mask = left_padded([7, 5], 7)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        actual = lisa_copy(reference)(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert len(actual) == len(expected) == 5
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        model = converted("sparse chain, FASC")
        states = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert len(states) == 5
        torch.testing.assert_close(states[0], model.model.embed_tokens(ids))
        torch.testing.assert_close(states[-1], model.model(ids, attention_mask=mask).last_hidden_state)


def test_attentions_equal_llama_eager_attentions_where_nothing_is_converted():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = lisa_copy(reference)  # SDPA for its full layers: output_attentions materialises them
    reference.set_attn_implementation("eager")
    ids, mask = left_padded([7, 5], 7)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, output_attentions=True).attentions
        actual = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(actual) == len(expected) == 4
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", SPECS)
def test_attentions_of_converted_layers_are_the_softmax_of_their_scores(name, monkeypatch):
    """Every layer's probabilities equal the eager reference's softmax (materialised scores, repeat_kv), with blocks of
    3 query rows, left padding, and at a decode step; the logits stay those of the fast paths."""
    model = converted(name)
    ids, mask = left_padded([9, 6], 9)
    recorded, softmax = [], torch.softmax

    def recording_softmax(*args, **kwargs):  # the eager reference's one softmax per layer
        recorded.append(softmax(*args, **kwargs))
        return recorded[-1]

    with monkeypatch.context() as patch:
        patch.setattr(torch, "softmax", recording_softmax)
        eager_logits(model, ids, mask)
    with torch.no_grad():
        fast = model(ids, attention_mask=mask).logits
        monkeypatch.setattr(lisa_attention, "SCORE_BLOCK_ELEMENTS", 2 * 4 * 9 * 3)  # B x H x keys x 3 rows
        out = model(ids, attention_mask=mask, output_attentions=True, use_cache=True)
        longer = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = model(ids[:, -1:], attention_mask=longer, cache=out.cache, output_attentions=True)
    real = mask.bool()
    assert len(out.attentions) == len(recorded) == 4
    for got, want in zip(out.attentions, recorded):
        torch.testing.assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits[real], fast[real], atol=1e-5, rtol=1e-4)
    for probs in step.attentions:
        assert probs.shape == (2, 4, 1, 10)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 1))
        assert (probs[1, :, :, :3] == 0).all()  # the padding of the second prompt


def test_return_dict_false_returns_llamas_tuple():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    model = converted("sparse then dense")
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        for kwargs in ({}, {"labels": ids}, {"use_cache": False}):
            expected = reference(ids, return_dict=False, **kwargs)
            actual = model(ids, return_dict=False, **kwargs)
            as_dict = model(ids, **kwargs).to_tuple()
            assert isinstance(actual, tuple) and [type(x) for x in actual] == [type(x) for x in expected]
            for got, want in zip(actual, as_dict):
                if isinstance(got, torch.Tensor):
                    torch.testing.assert_close(got, want)


def test_no_external_attention_backend_but_sdpa_for_full_layers():
    """vLLM's and TGI's Transformers backends cannot hand a LISA layer the scores of the layer below."""
    model = converted("sparse")
    assert not type(model).is_backend_compatible()
    assert model.config._attn_implementation == "sdpa"
