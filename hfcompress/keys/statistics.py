"""The key statistics of a whole model (transformers' classes, in memory) on calibration tokens.

Per attention layer, over every calibration token (float64 accumulators):
- C = E[k k^T], k the pre-RoPE key of all KV heads side by side (after the family's k_norm where it has one);
- G = E[g g^T], g = d loss / d k for the token-summed cross entropy (only when asked: it needs a backward pass);
- q2 = E[q^2] per query coordinate (pre-RoPE, after q_norm): the energy of the queries that read the keys.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class KeyStatistics:
    C: torch.Tensor  # (width, width), width = KV heads x head_dim
    q2: torch.Tensor  # (heads x head_dim,)
    G: torch.Tensor | None = None  # (width, width), when gradients were collected
    tokens: int = 0


# transformers' attention classes of these model types apply k_norm after moving the heads before the tokens: their
# key module's output is (B, KV, T, d), every other one's (B, T, KV, d) (or (B, T, KV x d) from k_proj)
HEADS_FIRST_AT_KEY_NORM = ("gemma3_text",)


def token_rows(output: torch.Tensor, width: int, heads_first: bool) -> torch.Tensor:
    """The key module's output as (tokens, width) rows, all KV heads of one token side by side."""
    return (output.transpose(1, 2) if heads_first else output).reshape(-1, width)


def heads_first_keys(model: nn.Module, attention: nn.Module) -> bool:
    """Whether `attention`'s key module (of `model`) puts the heads before the tokens."""
    return getattr(attention, "k_norm", None) is not None and model.config.model_type in HEADS_FIRST_AT_KEY_NORM


def key_module(attention: nn.Module) -> nn.Module:
    """The module whose output is a layer's pre-RoPE key: the per-head k_norm (Qwen3, Gemma 3) or k_proj."""
    norm = getattr(attention, "k_norm", None)
    return attention.k_proj if norm is None else norm


def query_module(attention: nn.Module) -> nn.Module:
    norm = getattr(attention, "q_norm", None)
    return attention.q_proj if norm is None else norm


def run_sequences(model: nn.Module, sequences: torch.Tensor, gradients: bool) -> int:
    """Every sequence of `sequences` (N, T) through `model` one at a time, each with a backward pass of its summed cross
    entropy when `gradients` (the hooks of the caller see the activations' gradients, the weights get none); returns
    the tokens run."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)  # the gradients wanted are the activations', not the weights'
    tokens = 0
    try:
        for sequence in sequences:
            ids = sequence.unsqueeze(0)
            if gradients:
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
                nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="sum").backward()
            else:
                with torch.no_grad():
                    model(ids, use_cache=False)
            tokens += ids.shape[1]
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return tokens


def key_statistics(model: nn.Module, sequences: torch.Tensor, gradients: bool = False) -> list[KeyStatistics]:
    """Per decoder layer of transformers' causal LM `model`, its KeyStatistics over `sequences` (N, T)."""
    layers = model.model.layers
    width = layers[0].self_attn.k_proj.out_features
    queries = layers[0].self_attn.q_proj.out_features
    stats = [
        KeyStatistics(torch.zeros(width, width, dtype=torch.float64), torch.zeros(queries, dtype=torch.float64),
                      torch.zeros(width, width, dtype=torch.float64) if gradients else None)
        for _ in layers
    ]  # fmt: skip

    def on_key(entry: KeyStatistics, heads_first: bool):
        def hook(module, inputs, output):
            # the statistics stay on the CPU, any device
            flat = token_rows(output.detach(), width, heads_first).double().cpu()
            entry.C += flat.T @ flat
            if gradients:

                def on_grad(grad: torch.Tensor) -> None:
                    flat_grad = token_rows(grad, width, heads_first).double().cpu()
                    entry.G.add_(flat_grad.T @ flat_grad)

                output.register_hook(on_grad)

        return hook

    def on_query(entry: KeyStatistics, heads_first: bool):
        def hook(module, inputs, output):
            entry.q2 += token_rows(output.detach(), queries, heads_first).double().pow(2).sum(0).cpu()

        return hook

    handles = []
    for layer, entry in zip(layers, stats):
        handles.append(key_module(layer.self_attn).register_forward_hook(on_key(entry, heads_first_keys(model, layer.self_attn))))
        handles.append(query_module(layer.self_attn).register_forward_hook(on_query(entry, heads_first_keys(model, layer.self_attn))))
    try:
        tokens = run_sequences(model, sequences, gradients)
    finally:
        for handle in handles:
            handle.remove()
    for entry in stats:
        entry.C /= tokens
        entry.q2 /= tokens
        if entry.G is not None:
            entry.G /= tokens
        entry.tokens = tokens
    return stats


@contextmanager
def projected_keys(model: nn.Module, projectors: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside, layer l's pre-RoPE keys are k -> P_l k (`projectors`: layer index -> (width, width)); transformers' own
    classes compute everything else. Exact for both layouts: a RoPE-commuting P gives the scores its latent would."""

    def project(matrix: torch.Tensor, heads_first: bool):
        def hook(module, inputs, output):
            flat = token_rows(output, matrix.shape[0], heads_first) @ matrix.to(output.device, output.dtype).T
            if heads_first:  # back to (B, KV, T, d)
                batch, heads, length, dim = output.shape
                return flat.reshape(batch, length, heads, dim).transpose(1, 2)
            return flat.reshape(output.shape)

        return hook

    layers = model.model.layers
    handles = [
        key_module(layers[l].self_attn).register_forward_hook(project(p, heads_first_keys(model, layers[l].self_attn)))
        for l, p in projectors.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def projected_values(model: nn.Module, projectors: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside, layer l's values (v_proj's output, all KV heads side by side) are v -> P_l v (`projectors`: layer index ->
    (width, width)): what a cached value latent gives, in transformers' own classes."""

    def project(matrix: torch.Tensor):
        def hook(module, inputs, output):
            return output @ matrix.to(output.device, output.dtype).T

        return hook

    layers = model.model.layers
    handles = [layers[l].self_attn.v_proj.register_forward_hook(project(p)) for l, p in projectors.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
