"""Converted checkpoints and their remote-code reference outputs, for the vLLM plugin tests (tests/vllm/).

Runs in the main environment (.venv: hfcompress's transformers and remote code), not in .venv-vllm (vLLM pins an older
transformers): `python tests/vllm/reference.py OUT_DIR NAME [NAME ...]` writes OUT_DIR/NAME/ (a converted repo:
config.json with auto_map, model.safetensors, the remote-code files, tokenizer) and OUT_DIR/NAME.json (prompts, the
remote code's greedy tokens and their log-probabilities, fp32, loaded from the written directory with
trust_remote_code=True in this process, each prompt alone, with the remote code's own cache). `NAME=DIR` references a
model directory as it is (a real conversion's output or an original) on the smollm2 case's prompts: OUT_DIR/NAME.json.

Models (NAME): a tiny random checkpoint per family (tests/test_families.py's), converted in memory with the repo's own
APIs (`converted_config`, the family's remote classes, `save_companion_files`): sparse-Align shared layers (a chain where
the family allows one), FASC-factorised linears, a dropped-attention layer and key latents (`key_ranks`); "llama-own" has head matchings across KV
groups (served with a shared layer's own cache in the concatenated-feature layouts); "mistral-values" has value latents
(`value_ranks`: with a key latent, alone on the root of a shared layer, alone); "llama-wide" is a Llama of head_dim
32, which stock vLLM serves on CPU too: its original is written as well (OUT_DIR/llama-wide-original and its
transformers reference, llama-wide-original.json), for the fp8 KV cache comparison; "smollm2" is the real
SmolLM2-135M-Instruct with 8 shared layers (grouped head matching, chains of 2), down_proj of 4 layers factorised by a truncated SVD and one dropped attention.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: test_families, tiny_models

NEW_TOKENS = 8
PROMPTS = 32


def grouped_sources(heads: int, kv: int, generator: torch.Generator) -> list[int]:
    """Each KV group's heads read heads of one KV group below, different groups different ones (servable with one
    cache per group of layers)."""
    g = heads // kv
    perm = torch.randperm(kv, generator=generator).tolist()
    return [perm[h // g] * g + int(torch.randint(g, (1,), generator=generator)) for h in range(heads)]


def free_sources(heads: int, generator: torch.Generator) -> list[int]:
    return torch.randperm(heads, generator=generator).tolist()


# name -> (family case of test_families, lisa layers, layers whose sources cross KV groups, fasc linears, dropped,
# layers with low-rank keys: the root below a shared layer among them; the plugin caches their latent, the root's handed
# to the shared layers above)
TINY = {
    "llama": ("llama", [1, 2], False, ["1.mlp.down_proj", "2.self_attn.o_proj", "0.self_attn.q_proj"], [3], [0]),
    "llama-own": ("llama", [2, 3], True, ["3.mlp.gate_proj"], [], [0, 1]),
    "mistral": ("mistral", [2], False, ["2.self_attn.v_proj"], [3], [0, 1]),
    "qwen2": ("qwen2", [1, 3], False, ["0.self_attn.k_proj"], [], [0, 2]),
    "qwen3": ("qwen3", [1, 2], False, ["1.mlp.up_proj"], [3], [0]),
    "gemma3": ("gemma3", [1, 3], False, ["3.mlp.down_proj"], [], [0, 2]),
    "llama-wide": ("llama-wide", [1, 2], False, ["1.mlp.down_proj"], [3], [0]),
}
# name -> layers with low-rank values (`value_ranks`, rank width / 2 + 1: shares zero-padded), for the TINY entries that
# have them: "mistral-values" (a window in every layer, head_dim 24) has a value latent with a key latent (0), alone on the
# root of a shared layer (1, whose V is FASC-factorised too: its rotated keys handed to layer 2) and alone (3)
TINY["mistral-values"] = ("mistral", [2], False, ["1.self_attn.v_proj"], [], [0])
VALUE_LAYERS = {"mistral-values": [0, 1, 3]}


def tiny_original(case: str):
    if case in ("llama", "llama-wide"):
        from transformers import LlamaConfig, LlamaForCausalLM
        from tiny_models import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        hidden = 128 if case == "llama-wide" else 64  # head_dim 32: a head size vLLM's CPU backend takes unpadded
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(torch.randn(param.shape) * 0.2)
        return model, tokenizer
    from test_families import tiny_model
    from tiny_models import build_tiny_tokenizer

    return tiny_model(case), build_tiny_tokenizer()


def convert_in_memory(original, lisa: list[int], cross_groups: bool, fasc: dict[str, int], dropped: list[int], seed: int,
                      key_layers: tuple[int, ...] = (), value_layers: tuple[int, ...] = ()):  # fmt: skip
    """The family's converted model of `original` with these LISA layers (sparse Align, low-rank keys per KV group,
    small random low-rank Q/K, scales near 1), FASC linears (truncated SVD of the original weight), dropped attentions,
    key latents (`key_ranks`: a random rank-(width*3/4) orthogonal projection of the keys) and value latents
    (`value_ranks`: a random rank-(width/2+1) orthogonal projection of the values)."""
    from hfcompress.conversion.build import converted_config
    from hfcompress.families import family_of

    cfg = original.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rank = 20 if cfg.hidden_size >= 256 else 8  # SmolLM2: the converter's default rank (keys per KV group)
    spec = {str(i): {"rank": rank, "align": "sparse", "align_hidden": 0, "key_heads": kv} for i in lisa}
    entries = {"lisa_layers": spec, "fasc_ranks": fasc}
    if dropped:
        entries["dropped_attention_layers"] = dropped
    width = kv * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if key_layers:
        entries["key_ranks"] = {str(i): width * 3 // 4 for i in key_layers}
    if value_layers:
        entries["value_ranks"] = {str(i): width // 2 + 1 for i in value_layers}
    config = converted_config(cfg, entries)
    _, cls = family_of(config).remote_classes()
    model = cls(config).eval()
    state = original.state_dict()
    own = model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
        for path, rank in fasc.items():
            weight = state[f"model.layers.{path}.weight"].double()
            u, s, vh = torch.linalg.svd(weight, full_matrices=False)
            module = model.model.layers[int(path.split(".")[0])].get_submodule(path.split(".", 1)[1])
            module.proj_out.weight.copy_((u[:, :rank] * s[:rank]).float())
            module.proj_in.weight.copy_(vh[:rank].float())
            if module.proj_out.bias is not None:
                module.proj_out.bias.copy_(state[f"model.layers.{path}.bias"])
        for idx in lisa:
            attn = model.model.layers[idx].self_attn
            attn.q_lowrank.weight.copy_(torch.randn(attn.q_lowrank.weight.shape, generator=generator) * 0.1)
            attn.k_lowrank.weight.copy_(torch.randn(attn.k_lowrank.weight.shape, generator=generator) * 0.1)
            attn.align.scale.copy_(1 + 0.2 * torch.randn(heads, generator=generator))
            sources = free_sources(heads, generator) if cross_groups else grouped_sources(heads, kv, generator)
            attn.align.source.copy_(torch.tensor(sources))
        for idx in key_layers:
            basis, _ = torch.linalg.qr(torch.randn(width, width * 3 // 4, generator=generator, dtype=torch.float64))
            latent = model.model.layers[idx].self_attn.key_latent
            latent.proj_in.weight.copy_(basis.T.float())
            latent.proj_out.weight.copy_(basis.float())
        for idx in value_layers:
            basis, _ = torch.linalg.qr(torch.randn(width, width // 2 + 1, generator=generator, dtype=torch.float64))
            latent = model.model.layers[idx].self_attn.value_latent
            latent.proj_in.weight.copy_(basis.T.float())
            latent.proj_out.weight.copy_(basis.float())
    return model


def save(model, tokenizer, out: Path) -> None:
    from hfcompress.conversion.build import save_companion_files

    model.save_pretrained(out)
    save_companion_files(tokenizer, None, out)


def prompts_for(tokenizer, count: int, max_len: int, seed: int) -> list[list[int]]:
    """`count` prompts of real text (the CPython docs) of mixed lengths 3..max_len tokens; every fourth one starts with
    the same 48-token prefix (a prefix-cache hit when it is served after the first)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))[:400_000]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    generator = torch.Generator().manual_seed(seed)
    prefix = ids[1000:1048]
    out = []
    for i in range(count):
        length = int(torch.randint(3, max_len + 1, (1,), generator=generator))
        start = int(torch.randint(0, len(ids) - max_len, (1,), generator=generator))
        body = ids[start : start + length]
        out.append((prefix + body)[:max_len] if i % 4 == 3 else body)
    return out


@torch.no_grad()
def greedy_reference(out: Path, prompts: list[list[int]]) -> dict:
    """The remote code's (or an original's: transformers') greedy continuation of each prompt (alone, its own cache) and
    the log-prob of each chosen token, loaded from `out` as a user would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        result = model(ids, use_cache=True)
        chosen, lps = [], []
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(result.logits[0, -1].double(), dim=-1)
            token = int(logp.argmax())
            chosen.append(token)
            lps.append(float(logp[token]))
            result = model(torch.tensor([[token]]), cache=result.cache, use_cache=True)
        tokens.append(chosen)
        logprobs.append(lps)
    return {"prompts": prompts, "tokens": tokens, "logprobs": logprobs, "class": type(model).__name__}


def build(name: str, root: Path) -> None:
    out = root / name
    if name == "smollm2":
        from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source

        original, tokenizer = load_source(resolve_source(BUILTIN_SOURCE))
        original = original.float()
        original.save_pretrained(root / "smollm2-original")  # the original, to compare vLLM's KV capacity with
        tokenizer.save_pretrained(root / "smollm2-original")
        fasc = {f"{i}.mlp.down_proj": 288 for i in (3, 9, 17, 25)}
        model = convert_in_memory(original, [5, 6, 12, 13, 19, 20, 26, 27], False, fasc, [23], seed=5)
        max_len = 300
    else:
        case, lisa, cross, fasc_paths, dropped, key_layers = TINY[name]
        original, tokenizer = tiny_original(case)
        fasc = {path: 16 for path in fasc_paths}
        model = convert_in_memory(original, lisa, cross, fasc, dropped, seed=len(name), key_layers=tuple(key_layers),
                                  value_layers=tuple(VALUE_LAYERS.get(name, ())))
        max_len = 120
    save(model, tokenizer, out)
    prompts = prompts_for(tokenizer, PROMPTS, max_len, seed=7)
    (root / f"{name}.json").write_text(json.dumps(greedy_reference(out, prompts)))
    if name == "llama-wide":  # the original too, with its own reference on the same prompts
        original.save_pretrained(root / f"{name}-original")
        tokenizer.save_pretrained(root / f"{name}-original")
        (root / f"{name}-original.json").write_text(json.dumps(greedy_reference(root / f"{name}-original", prompts)))


def reference_of(path: Path, out: Path) -> None:
    """The reference of a model directory as it is (a real `hfcompress convert` output, or an original): the smollm2
    case's prompts (real text, 3-300 tokens) on its tokenizer, written to `out`."""
    from transformers import AutoTokenizer

    prompts = prompts_for(AutoTokenizer.from_pretrained(path), PROMPTS, 300, seed=7)
    out.write_text(json.dumps(greedy_reference(path, prompts)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        if "=" in name:  # NAME=DIR: a directory as it is, its reference to OUT_DIR/NAME.json
            name, path = name.split("=", 1)
            reference_of(Path(path), root / f"{name}.json")
        else:
            build(name, root)
        print(f"reference: {name} written", flush=True)
