"""Decoder layers streamed one at a time: built from checkpoint tensors on the meta device, onloaded to the compute
device, run over hidden states in batches, offloaded. Also the data-parallel processes (accelerate) and the
chunked lm_head loss, so that neither a whole model nor a (T x vocab) logits tensor is ever needed.
"""

import torch
from accelerate import PartialState
from torch import nn

from .build import converted_config
from .checkpoint import Checkpoint
from ..families import family_of
from ..lisa import causal_mask
from ..remote import import_remote

NLL_CHUNK = 128  # positions per lm_head product: the logits of a whole sequence (T x vocab) are never held


class Processes:
    """This process's place among the data-parallel processes accelerate started (one process without it).

    Reductions run over gloo on CPU tensors whatever the compute device, so the same code serves CPUs and GPUs."""

    def __init__(self) -> None:
        self.state = PartialState(cpu=True)
        self.count, self.index, self.is_main = self.state.num_processes, self.state.process_index, self.state.is_main_process

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.count > 1:
            on_cpu = tensor.cpu()
            torch.distributed.all_reduce(on_cpu)
            tensor.copy_(on_cpu)
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenation of every process's tensor along dim 0, in process order (all have the same shape)."""
        if self.count == 1:
            return tensor
        parts = [torch.empty_like(tensor, device="cpu") for _ in range(self.count)]
        torch.distributed.all_gather(parts, tensor.cpu().contiguous())
        return torch.cat(parts).to(tensor.device)

    def agreed_minimum(self, value: int) -> int:
        if self.count == 1:
            return value
        agreed = torch.tensor(value)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        return int(agreed)

    def wait(self) -> None:
        self.state.wait_for_everyone()


class LayerStream:
    """Builds decoder layers of the source (or of a converted config) from tensors and runs them on `device`, in the
    converted classes of the source's family."""

    def __init__(self, source_config, checkpoint: Checkpoint, device: torch.device, batch_size: int = 4) -> None:
        self.family = family_of(source_config)
        self.modeling = self.family.modeling()
        self.lisa_attention = import_remote("lisa_attention")
        # the classes the family's converted model is built from (its LisaModel subclass names them)
        self.model_class = getattr(self.modeling, self.family.model_class)
        self.decoder_layer = self.model_class.decoder_layer_class
        self.source_config = source_config
        self.checkpoint = checkpoint
        self.device = device
        self.batch_size = batch_size
        self.config = self.layer_config({})  # the original model, in the converted classes
        self.num_layers = self.config.num_hidden_layers
        self.rotary_emb = self.model_class.rotary_class(config=self.config).to(device)
        with torch.device("meta"):
            self.layer_keys = list(self.decoder_layer(self.config, 0).state_dict())

    def layer_config(self, entries: dict):
        """Converted config (methods' entries) for building layers here; SDPA reads the explicit additive mask."""
        config = converted_config(self.source_config, entries)
        config._attn_implementation = "sdpa"
        return config

    def original_state(self, idx: int) -> dict[str, torch.Tensor]:
        return self.checkpoint.load([f"model.layers.{idx}.{key}" for key in self.layer_keys])

    def build(self, config, idx: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """Decoder layer `idx` of `config` holding `state` (full key names), float32, on the device, frozen."""
        with torch.device("meta"):
            layer = self.decoder_layer(config, idx)
        prefix = f"model.layers.{idx}."
        layer.load_state_dict({k.removeprefix(prefix): _working(v, self.device) for k, v in state.items()}, assign=True)
        return layer.eval().requires_grad_(False)

    def original_layer(self, idx: int) -> nn.Module:
        return self.build(self.config, idx, self.original_state(idx))

    def cos_sin(self, seq_len: int, layer: int = 0):
        """RoPE (cos, sin) of positions 0..seq_len-1 for decoder layer `layer` (Gemma 3's bases differ per attention
        type)."""
        positions = torch.arange(seq_len, device=self.device).unsqueeze(0)
        kind = self.config.attention_types[layer]
        x = torch.zeros(1, seq_len, 1, device=self.device)
        return self.lisa_attention.rotary_embeddings(self.rotary_emb, x, positions, [kind])[kind]

    def handoff(self, config, idx: int) -> str | None:
        """What layer `idx` of `config` hands to the next one at prefill (lisa_attention.handoff_to_next_layer)."""
        return self.lisa_attention.handoff_to_next_layer(config, idx)

    def run(self, layer: nn.Module, hidden: torch.Tensor, prev=None, handoff: str | None = None):
        """(layer output, what it hands to the next layer) for sequences of one length, each batch onloaded to the
        device and the results returned where `hidden` lives. `prev` is what the layer below handed over: scores, or
        a (query, key) tuple for a sparse Align. The explicit additive causal mask (with the layer's sliding window)
        serves every attention backend."""
        seq_len, home = hidden.shape[1], hidden.device
        window = layer.self_attn.sliding_window if layer.self_attn is not None else None  # None: attention dropped
        mask = causal_mask(seq_len, device=self.device, window=window)
        cos_sin = self.cos_sin(seq_len, layer.layer_idx)  # of the layer's attention type
        positions = torch.arange(seq_len, device=self.device).unsqueeze(0)
        kind = self.config.attention_types[layer.layer_idx]
        key_rotary = self.lisa_attention.KeyRotary(self.rotary_emb, hidden[:1, :1].to(self.device), kind)  # low-rank keys
        outputs, passed = [], []
        for start in range(0, len(hidden), self.batch_size):
            part = slice(start, start + self.batch_size)
            batch = hidden[part].to(self.device)
            out, handed = layer(
                batch, attention_mask=mask, additive_mask=mask, position_ids=positions.expand(len(batch), -1),
                position_embeddings=cos_sin, prev=_move(_part(prev, part), self.device), handoff=handoff,
                key_rotary=key_rotary,
            )
            outputs.append(out.to(home))
            passed.append(_move(handed, home) if handoff else None)
        return torch.cat(outputs), _concat(passed) if handoff else None

    def head(self, rounded_to: torch.dtype | None = None) -> tuple[nn.Module, torch.Tensor]:
        """(final norm, lm_head weight) in float32 on the device, optionally as saved in `rounded_to`; a tied lm_head is
        the embedding matrix."""
        tied = self.config.tie_word_embeddings
        names = ["model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"]
        tensors = {k: _rounded(v, rounded_to) for k, v in self.checkpoint.load(names).items()}
        norm = self.model_class.norm_class(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight.data = tensors[names[0]].float()
        return norm.to(self.device).requires_grad_(False), tensors[names[1]].to(self.device, torch.float32)

    def embed(self, ids: list[torch.Tensor], rounded_to: torch.dtype | None = None) -> list[torch.Tensor]:
        """Input embeddings of each id tensor (float32, on the CPU: hidden states live there between layers),
        optionally of the embedding matrix as saved in `rounded_to`; the matrix is read once for all of them. A family
        that scales its embeddings (the config's `embedding_scale`, Gemma 3's sqrt(hidden)) scales them as its model
        does in float32, the dtype the layers run in here and the reload check loads the saved weights in (Gemma
        rounds the scale to the dtype it runs in, not to the saved one)."""
        weight = _rounded(self.checkpoint.load(["model.embed_tokens.weight"])["model.embed_tokens.weight"], rounded_to)
        scale = getattr(self.config, "embedding_scale", None)
        factor = 1 if scale is None else torch.tensor(scale, dtype=torch.float32)
        return [nn.functional.embedding(part, weight).float() * factor for part in ids]


def _working(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 on `device` for floating tensors; integer buffers (a sparse Align's head indices) keep their dtype."""
    return tensor.to(device, torch.float32) if tensor.is_floating_point() else tensor.to(device)


def _rounded(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _part(value, part: slice):
    if value is None:
        return None
    return tuple(v[part] for v in value) if isinstance(value, tuple) else value[part]


def _move(value, device):
    if value is None:
        return None
    return tuple(v.to(device) for v in value) if isinstance(value, tuple) else value.to(device)


def _concat(values: list):
    if isinstance(values[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*values))
    return torch.cat(values)


def token_nll(
    norm: nn.Module, lm_head: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, with_grad: bool = False
) -> tuple[float, torch.Tensor | None]:
    """Summed next-token negative log-likelihood of one sequence (T, d), and (with_grad) its gradient with respect to
    `hidden`; computed a chunk of positions at a time on lm_head's device (each position's loss depends on its own
    hidden state only)."""
    device = lm_head.device
    ids = ids.to(device)
    total, grads = 0.0, []
    for start in range(0, len(ids) - 1, NLL_CHUNK):
        end = min(start + NLL_CHUNK, len(ids) - 1)
        part = hidden[start:end].detach().to(device).requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            loss = nn.functional.cross_entropy((norm(part) @ lm_head.T).float(), ids[start + 1 : end + 1], reduction="sum")
            if with_grad:
                grads.append(torch.autograd.grad(loss, part)[0].to(hidden.device))
        total += loss.item()
    if not with_grad:
        return total, None
    return total, torch.cat([*grads, torch.zeros_like(hidden[-1:])])  # the last position predicts nothing
