"""Tiny, fully offline models for tests.

``save_tiny_llama(out_dir)`` writes a small random ``LlamaForCausalLM`` (safetensors) plus a real byte-level BPE
tokenizer trained on the CPython docs shipped in ``pydoc_data.topics`` (no network, deterministic).
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

TINY_LLAMA_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


def _training_text(max_chars: int = 120_000) -> list[str]:
    from pydoc_data.topics import topics

    out, total = [], 0
    for key in sorted(topics):
        out.append(topics[key])
        total += len(topics[key])
        if total >= max_chars:
            break
    return out


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = 512):
    """A real ``PreTrainedTokenizerFast`` (byte-level BPE, ``vocab_size`` tokens incl. <unk>/<s>/</s>)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=TINY_LLAMA_DEFAULTS["max_position_embeddings"],
    )


def _llama_config_dict(tokenizer_vocab: int, overrides: dict) -> dict:
    from importlib.metadata import version

    p = dict(TINY_LLAMA_DEFAULTS)
    p.update(vocab_size=tokenizer_vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    p.update(overrides)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": p["bos_token_id"],
        "dtype": "float32",
        "eos_token_id": p["eos_token_id"],
        "head_dim": p["hidden_size"] // p["num_attention_heads"],
        "hidden_act": "silu",
        "hidden_size": p["hidden_size"],
        "initializer_range": p.get("initializer_range", 0.02),
        "intermediate_size": p["intermediate_size"],
        "max_position_embeddings": p["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": p["num_attention_heads"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_key_value_heads": p["num_key_value_heads"],
        "pad_token_id": p["pad_token_id"],
        "pretraining_tp": 1,
        "rms_norm_eps": p.get("rms_norm_eps", 1e-06),
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": p["tie_word_embeddings"],
        "transformers_version": version("transformers"),
        "use_cache": True,
        "vocab_size": p["vocab_size"],
    }
    extra = set(overrides) - set(cfg) - {"initializer_range", "rms_norm_eps"}
    if extra:
        raise ValueError(f"fast tiny llama does not support config overrides {sorted(extra)}: use method='transformers'")
    return cfg


def _write_safetensors(path: Path, tensors: dict) -> None:
    import numpy as np

    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        blob = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    header = {"__metadata__": {"format": "pt"}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def _save_tiny_llama_fast(out_dir: Path, seed: int, vocab_size: int, overrides: dict) -> None:
    """Same files as ``save_pretrained`` (config, generation_config, model.safetensors, tokenizer.json,
    tokenizer_config.json) written with numpy + tokenizers only: no torch/transformers import (~0.3 s)."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    cfg = _llama_config_dict(tok.get_vocab_size(), overrides)
    rng = np.random.Generator(np.random.PCG64(seed))
    std = cfg["initializer_range"]
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]

    def normal(*shape):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(v, h)}
    tensors["model.embed_tokens.weight"][cfg["pad_token_id"]] = 0.0  # like nn.Embedding(padding_idx=...) init
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        tensors[pre + "self_attn.q_proj.weight"] = normal(q, h)
        tensors[pre + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[pre + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[pre + "self_attn.o_proj.weight"] = normal(h, q)
        tensors[pre + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[pre + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[pre + "mlp.down_proj.weight"] = normal(h, inter)
        tensors[pre + "input_layernorm.weight"] = np.ones(h, np.float32)
        tensors[pre + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(v, h)
    _write_safetensors(out_dir / "model.safetensors", tensors)

    gen = {
        "_from_model_config": True,
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "output_attentions": False,
        "output_hidden_states": False,
        "pad_token_id": cfg["pad_token_id"],
        "transformers_version": cfg["transformers_version"],
        "use_cache": True,
    }
    tok_cfg = {
        "backend": "tokenizers",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": cfg["max_position_embeddings"],
        "pad_token": "</s>",
        "tokenizer_class": "TokenizersBackend",
        "unk_token": "<unk>",
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)


def save_tiny_llama(
    out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512, method: str = "fast", **config_overrides
) -> Path:
    """Save a tiny random ``LlamaForCausalLM`` + tokenizer to ``out_dir`` (created). Returns ``Path(out_dir)``.

    Defaults: hidden 64, 4 layers, 4 heads, 2 kv heads, intermediate 128, vocab 512 (~0.21M params, ~0.86 MB fp32,
    untied lm_head). Weights are deterministic for a given ``seed`` (but differ between the two methods).

    ``method="fast"`` (default) writes the exact files ``save_pretrained`` writes with numpy + tokenizers only (no
    torch/transformers import: importing transformers costs ~15 s on a 2-core box). ``method="transformers"`` builds a
    real ``LlamaForCausalLM`` (torch init) and a ``PreTrainedTokenizerFast`` and calls ``save_pretrained`` on both.
    ``config_overrides`` go to the config (``LlamaConfig`` kwargs; the fast method supports the default keys only).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if method == "fast":
        _save_tiny_llama_fast(out_dir, seed, vocab_size, config_overrides)
        return out_dir
    if method != "transformers":
        raise ValueError(f"unknown method {method!r}")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(vocab_size)
    params = dict(TINY_LLAMA_DEFAULTS)
    params.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    params.update(config_overrides)
    config = LlamaConfig(**params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
