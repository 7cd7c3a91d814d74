"""Model families beyond Llama (issue 15): Mistral, Qwen2 / Qwen2.5, Qwen3 and Gemma 3 (text).

Each family's tiny random checkpoint is made by transformers' own config and model classes and saved with
`save_pretrained`, with the real BPE tokenizer of tests/tiny_models.py. transformers initialises biases at 0 and norms
at 1 (Gemma's (1 + w) norms at 0): they are perturbed, so that Qwen2's q/k/v biases and the q/k norms change the
scores. The windows (6) are shorter than the test sequences (16), so the sliding-window masks and caches are exercised.
Gemma 3's tiny model interleaves sliding and full layers with their own RoPE bases, ties its embeddings and scales its
attention by a `query_pre_attn_scalar` that is not its head_dim.

- The converted classes with nothing converted compute transformers' logits (left-padded batches too), and generate
  the same with and without the cache.
- A LISA layer of a sliding-window type applies the window in every path (prefill, chunked prefill, decode, static
  cache), and shares only with a layer below of its own type.
- `hfcompress convert DIR` of every family (LISA and FASC both changing something) writes a repo that loads in a fresh
  process with `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` and generates, and ships exactly
  the .py files the family imports; its config.json states each shared layer's `source`, the head matching of its
  weights (the vLLM plugin lays out the cache from config.json alone).
- One family table (`configuration_lisa.FAMILIES` of the remote code): the converter's families are its entries, each
  builds its remote config and classes, and no reader (the converter's families, the remote configs, the plugin)
  names a family itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_shared_paths import left_padded
from tiny_models import build_tiny_tokenizer
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from typer.testing import CliRunner

from hfcompress.conversion.build import assemble, converted_config, in_converted_classes
from hfcompress.conversion.checkpoint import Checkpoint
from hfcompress.cli import app
from hfcompress.families import FAMILIES, family_of
from hfcompress.lisa import causal_mask, full_attention_scores, rotary
from hfcompress.remote import import_remote, kernels_dir, remote_code_files, uses_kernels
from hfcompress.sources.source import load_source, resolve_source
from hfcompress.conversion.stream import LayerStream

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
WINDOW = 6
# name -> (config class, causal-LM class, config overrides)
CASES = {
    # head_dim 24, not hidden / heads = 16; every layer has the window
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=24, sliding_window=WINDOW)),
    "mistral, no window": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    # layers 0-1 full attention, 2-3 sliding window (max_window_layers)
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, attention_bias=True)),
    # sliding, sliding, full, full: a shareable layer of each type (1, 3), each type with its own RoPE base
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        # hidden 80: sqrt(80) is not a bfloat16 number, so the embedding scale's rounding shows
        hidden_size=80, head_dim=24, query_pre_attn_scalar=16, sliding_window=WINDOW, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )),
}  # fmt: skip
LENGTH = 16


def tiny_model(name: str) -> torch.nn.Module:
    config_class, model_class, overrides = CASES[name]
    tokenizer = build_tiny_tokenizer()
    config = config_class(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{**TINY, **overrides},
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # biases and norm weights
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of the saved tiny checkpoint and tokenizer."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name in CASES:
        directory = root / name.replace(", ", "-").replace(" ", "-")
        tiny_model(name).save_pretrained(directory)
        build_tiny_tokenizer().save_pretrained(directory)
        dirs[name] = directory
    return dirs


def ids_and_mask(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded([LENGTH, 11 if padded else LENGTH], LENGTH)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens, logits of every step) of 6 greedy steps."""
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        output_logits=True, **kwargs,
    )  # fmt: skip
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(logits of every position, the cache) with the prompt fed through the cache in chunks: 8 tokens, then 4 (queries
    after a cached past), then one token at a time."""
    first = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
    second = model(ids[:, 8:12], attention_mask=mask[:, :12], cache=first.cache, use_cache=True)
    steps, cache = [first.logits, second.logits], second.cache
    for t in range(12, ids.shape[1]):
        step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        steps.append(step.logits)
        cache = step.cache
    return torch.cat(steps, dim=1), cache


def assert_same_generation(actual: tuple, expected: tuple) -> None:
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ nothing converted = transformers
@pytest.mark.parametrize("name", CASES)
def test_unconverted_model_equals_transformers(name, checkpoints):
    """The saved checkpoint, loaded by hfcompress (transformers' class of its family) and put into the converted classes
    with nothing shared or factorised: the same logits (one sequence, a left-padded batch) and the same generation,
    with the cache and without."""
    original, _ = load_source(resolve_source(str(checkpoints[name])))
    assert type(original) is CASES[name][1]
    converted = in_converted_classes(original)
    assert type(converted).__name__ == family_of(original.config).causal_lm_class
    with torch.no_grad():
        for padded in (False, True):
            ids, mask = ids_and_mask(padded)
            real = mask.bool()
            got, want = converted(ids, attention_mask=mask).logits, original(ids, attention_mask=mask).logits
            assert (got - want)[real].abs().max() <= 1e-4
    ids, mask = ids_and_mask(padded=True)
    cached = greedy(converted, ids, mask)
    assert_same_generation(cached, greedy(converted, ids, mask, use_cache=False))
    assert_same_generation(cached, greedy(original, ids, mask))


@pytest.mark.parametrize("name", CASES)
def test_teacher_assembled_from_the_checkpoint_equals_transformers(name, checkpoints):
    """The original the whole-model steps (distillation's teacher, the probe) assemble from the checkpoint in
    transformers' own classes, buffers the checkpoint does not hold included (Gemma 3's embedding scale), gives the
    logits of transformers' own from_pretrained."""
    original, _ = load_source(resolve_source(str(checkpoints[name])))
    _, causal_lm = family_of(original.config).transformers_classes()
    checkpoint = Checkpoint(checkpoints[name], name)
    teacher = assemble(original.config, checkpoint.load(list(checkpoint.files)), cls=causal_lm).eval()
    ids, mask = ids_and_mask(padded=True)
    with torch.no_grad():
        torch.testing.assert_close(teacher(ids, attention_mask=mask).logits, original(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_lisa_fit_targets_are_the_original_scores(name, checkpoints):
    """What LISA measures and fits against (`full_attention_scores` of the converted classes) is the original
    attention: Qwen2's q/k biases, Qwen3's q/k norms and layer 2's window included."""
    _, model_class, _ = CASES[name]
    original = model_class.from_pretrained(checkpoints[name], attn_implementation="eager").eval()
    attn_inputs = []
    layer = original.model.layers[2]
    hook = layer.self_attn.register_forward_pre_hook(lambda m, a, k: attn_inputs.append(k["hidden_states"]), with_kwargs=True)
    ids = torch.randint(3, 500, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = original(ids, output_attentions=True).attentions[2]
        hook.remove()
        attn = in_converted_classes(original).model.layers[2].self_attn
        x = attn_inputs[0]
        scores = full_attention_scores(attn, x, rotary(original, x))
    assert attn.sliding_window == (WINDOW if name == "qwen2" else None)
    got = torch.softmax(scores + causal_mask(LENGTH, window=attn.sliding_window), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_gemma3_lisa_fit_targets_are_the_original_scores(checkpoints):
    """Gemma 3: the scores LISA measures and fits against are the original attention in every layer (q/k norms,
    query_pre_attn_scalar, the sliding and the full RoPE base, the window), with the (cos, sin) the streamed layers get
    for their type; and the streamed embedding is Gemma's scaled one."""
    original = Gemma3ForCausalLM.from_pretrained(checkpoints["gemma3"], attn_implementation="eager").eval()
    inputs = {}

    def keep(idx: int):
        return lambda module, args, kwargs: inputs.update({idx: kwargs["hidden_states"]})

    layers = original.model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    ids = torch.randint(3, 500, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = original(ids, output_attentions=True)
        for hook in hooks:
            hook.remove()
        model = in_converted_classes(original).model
        lisa_attention = import_remote("lisa_attention")
        positions = torch.arange(LENGTH).unsqueeze(0)
        for idx, layer in enumerate(model.layers):
            attn, kind = layer.self_attn, model.config.attention_types[idx]
            assert kind == original.config.layer_types[idx] and attn.scaling == 16**-0.5
            cos_sin = lisa_attention.rotary_embeddings(model.rotary_emb, inputs[idx], positions, [kind])[kind]
            scores = full_attention_scores(attn, inputs[idx], cos_sin)
            got = torch.softmax(scores + causal_mask(LENGTH, window=attn.sliding_window), dim=-1)
            torch.testing.assert_close(got, out.attentions[idx], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(model.embed_tokens(ids), original.model.embed_tokens(ids))
    full, sliding = (
        lisa_attention.lowrank_rotary(model.config, 8, positions, torch.float32, kind)
        for kind in ("full_attention", "sliding_attention")
    )
    assert not torch.allclose(full[0], sliding[0])  # a LISA layer's low-rank RoPE has its type's base


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_streamed_layers_equal_transformers(name, checkpoints):
    """What the pipeline computes layer by layer (`LayerStream`: its embedding, each layer with the (cos, sin) of its
    attention type, the head) gives transformers' logits: Gemma 3's scaled embedding and per-type RoPE bases
    included."""
    original = CASES[name][1].from_pretrained(checkpoints[name]).eval()
    stream = LayerStream(original.config, Checkpoint(checkpoints[name], name), torch.device("cpu"))
    ids = torch.randint(3, 500, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = stream.embed([ids])[0]
        for idx in range(stream.num_layers):
            hidden, _ = stream.run(stream.original_layer(idx), hidden)
        norm, lm_head = stream.head()
        torch.testing.assert_close(norm(hidden) @ lm_head.T, original(ids).logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------- LISA across windows
def shared_model(name: str, spec: dict) -> torch.nn.Module:
    """The tiny model of `name` with the LISA layers of `spec` (random modules, sparse ones reading permuted heads)."""
    original = tiny_model(name)
    config = converted_config(original.config, {"lisa_layers": spec})
    _, cls = family_of(config).remote_classes()
    model = cls(config).eval()
    own = model.state_dict()
    missing = model.load_state_dict({k: v for k, v in original.state_dict().items() if k in own}, strict=False).missing_keys
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key in missing:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        for layer in model.model.layers:
            if layer.is_lisa and layer.self_attn.sparse:
                layer.self_attn.align.source.copy_(torch.randperm(4, generator=generator))
    return model


WINDOW_SPECS = {
    "qwen2 sparse": ("qwen2", {"3": {"rank": 4, "align": "sparse"}}),
    "qwen2 dense": ("qwen2", {"3": {"rank": 4, "align": "dense", "align_hidden": 8}}),
    "mistral sparse then dense": ("mistral", {"2": {"rank": 4, "align": "sparse"}, "3": {"rank": 2, "align": "dense", "align_hidden": 4}}),
    # a sliding LISA layer and a full one, each with its type's low-rank RoPE base
    "gemma3 dense, sparse": ("gemma3", {"1": {"rank": 4, "align": "dense", "align_hidden": 8}, "3": {"rank": 4, "align": "sparse"}}),
}


@pytest.mark.parametrize("case", WINDOW_SPECS)
def test_shared_layers_apply_the_window_in_every_path(case):
    """A LISA layer of a sliding-window type: its probabilities are 0 outside the window, and the fast paths (feature
    SDPA, block-wise scores) compute what the materialising path does; a prompt fed in chunks (queries after a cached
    past longer than the window) and then one token at a time gives the prefill's logits; a static cache generates
    what the dynamic one does."""
    model = shared_model(*WINDOW_SPECS[case])
    ids, mask = ids_and_mask(padded=True)
    real = mask.bool()
    # (query, key) outside the window, for real queries (a padded query's row is uniform: every key is masked)
    outside = ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril().triu(1 - WINDOW) & real[:, None, :, None]
    with torch.no_grad():
        fast = model(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask, output_attentions=True)
        for idx, probs in enumerate(out.attentions):
            if model.config.attention_types[idx] == "sliding_attention":
                assert (probs.masked_select(outside) == 0).all(), idx
        torch.testing.assert_close(out.logits[real], fast[real], atol=1e-5, rtol=1e-4)
    chunked, cache = chunked_logits(model, ids, mask)  # the windowed caches keep 5 positions
    torch.testing.assert_close(chunked[real], fast[real], atol=2e-4, rtol=1e-4)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "LisaDynamicSlidingLayer" in kinds and "DynamicSlidingWindowLayer" in kinds
    assert_same_generation(greedy(model, ids, mask, cache_implementation="static"), greedy(model, ids, mask))


def test_a_shared_layer_must_have_the_attention_type_of_the_layer_below(checkpoints, tmp_path):
    """Qwen2's layer 2 has a window and layer 1 none: the config refuses sharing layer 2, and so does the CLI, with one
    sentence, before any work."""
    with pytest.raises(Exception, match="a shared layer's anchor must have its attention type"):
        converted_config(tiny_model("qwen2").config, {"lisa_layers": {"2": {"rank": 2}}})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", str(checkpoints["qwen2"]), "--out", str(out), "--lisa-layers", "2,3"])
    assert result.exit_code == 2, result.output
    assert "--lisa-layers [2] cannot be shared" in result.output and "attention type" in result.output
    assert not out.exists()


# ------------------------------------------------------------------------------------------- hfcompress convert
FAST = [
    "--distill-tokens", "0", "--calib-sequences", "4", "--seq-len", "32", "--eval-tokens", "256", "--lisa-steps", "4",
    "--protect-first", "1", "--fasc-budget", "0.8", "--calib-text", "builtin", "--eval-text", "builtin",
    "--ood-text", "none", "--max-ppl-increase", "1000", "--no-speed", "--no-probe",
]  # fmt: skip
# name -> how LISA is chosen: Qwen2 by ratio (layer 2 is skipped: a window over a full layer), the others explicitly
CONVERT = {
    "mistral": ["--lisa-layers", "2"],
    "qwen2": ["--share-ratio", "0.5"],
    "qwen3": ["--lisa-layers", "2,3", "--lisa-align", "dense"],
    # one sliding, one full; saved as bfloat16: the reload check sees the embedding scale as the reloaded model does
    "gemma3": ["--lisa-layers", "1,3", "--dtype", "bfloat16"],
}
EXPECTED_LISA_LAYERS = {"mistral": [2], "qwen2": [1, 3], "qwen3": [2, 3], "gemma3": [1, 3]}

_LOAD = r"""
import json, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out, result_path = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
ids = tokenizer("def f(x):", return_tensors="pt").input_ids
with torch.no_grad():
    new = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
# the remote-code modules transformers itself copied and imported for this load
loaded = [m for name, m in list(sys.modules.items()) if name.startswith("transformers_modules.")]
files = sorted({Path(m.__file__).name for m in loaded if getattr(m, "__file__", None) and not m.__file__.endswith("__init__.py")})
Path(result_path).write_text(json.dumps({"class": type(model).__name__, "new_tokens": len(new), "modules": files}))
"""


@pytest.fixture(scope="module")
def convert_and_load(checkpoints, tmp_path_factory):
    """name -> (output directory of `hfcompress convert` in this process (a private cache; offline, as the calling
    test is), what a fresh process (offline, its own module cache) loaded from it: class, new tokens, the remote-code
    files transformers imported). Each family is converted once, when a test first asks for it."""
    root = tmp_path_factory.mktemp("family_outputs")
    done: dict[str, tuple[Path, dict]] = {}

    def run(name: str) -> tuple[Path, dict]:
        if name not in done:
            out = root / f"{name}-lisa"
            result = CliRunner().invoke(
                app, ["convert", str(checkpoints[name]), "--out", str(out), *FAST, *CONVERT[name]],
                env={"HFCOMPRESS_CACHE": str(root / "cache")},
            )  # fmt: skip
            assert result.exit_code == 0, result.output
            env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(root / f"hf_home-{name}"), TRANSFORMERS_VERBOSITY="error")
            env.pop("HF_MODULES_CACHE", None)
            result_path = root / f"{name}-load.json"
            proc = subprocess.run(
                [sys.executable, "-c", _LOAD, str(out), str(result_path)],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[name] = out, json.loads(result_path.read_text())
        return done[name]

    return run


def tensor_names(out: Path) -> set[str]:
    with safe_open(out / "model.safetensors", "pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize(
    "name", ["qwen2", *(pytest.param(name, marks=pytest.mark.slow) for name in ("mistral", "qwen3", "gemma3"))]
)  # about 30 s each on 2 cores: Qwen2 (biases, windows, the type rule in the ratio) in the fast tier
def test_convert_writes_a_repo_that_loads_and_generates(name, convert_and_load):
    out, loaded = convert_and_load(name)
    family = FAMILIES[name]
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert config["model_type"] == family.converted_model_type and config["auto_map"] == family.auto_map
    assert report["source"]["family"] == name and report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    assert sorted(int(k) for k in config["lisa_layers"]) == report["lisa"]["layers"] == EXPECTED_LISA_LAYERS[name]
    assert config["fasc_ranks"] and any(layer["rank"] for layer in report["fasc"]["layers"])
    assert f"- {name}\n" in (out / "README.md").read_text()  # the card's family tag

    assert loaded["class"] == family.causal_lm_class and loaded["new_tokens"] == 5
    shipped = sorted(p.name for p in out.glob("*.py"))
    # no layer here is dense Align with a key per head, the one the kernels serve: no kernels/ file ships (454 lines
    # of Triton), and the modeling's copy imports none (transformers wants every relative import in the repo)
    assert not uses_kernels(config) and not {p.name for p in kernels_dir().glob("*.py")} & set(shipped)
    # every file but the reference (shipped beside the model's code, imported by nothing) is imported when it loads
    assert shipped == sorted([*(p.name for p in remote_code_files(family.auto_map, kernels=False)), "lisa_reference.py"])
    assert [name for name in shipped if name != "lisa_reference.py"] == loaded["modules"]
    assert {f"{family.modeling_module}.py", f"{family.config_module}.py", "lisa_attention.py"} <= set(shipped)

    names = tensor_names(out)
    with safe_open(out / "model.safetensors", "pt") as handle:  # the cache layout of every shared layer, in config.json
        for layer, spec in config["lisa_layers"].items():  # a dense Align mixes every head: no source
            source = handle.get_tensor(f"model.layers.{layer}.self_attn.align.source").tolist() if spec["align"] == "sparse" else None
            assert spec.get("source") == source
    for layer in EXPECTED_LISA_LAYERS[name]:  # a shared layer drops q/k (biases, norms) and keeps V, O
        prefix = f"model.layers.{layer}.self_attn."
        assert not {n for n in names if n.startswith(prefix) and any(p in n for p in ("q_proj", "k_proj", "q_norm", "k_norm"))}
        assert {prefix + "q_lowrank.weight", prefix + "k_lowrank.weight"} <= names
        v_bias = {prefix + "v_proj.bias", prefix + "v_proj.proj_out.bias"} & names  # dense or factorised
        o_bias = {prefix + "o_proj.bias", prefix + "o_proj.proj_out.bias"} & names
        assert bool(v_bias) == (name in ("qwen2", "qwen3")) and bool(o_bias) == (name == "qwen3")  # qwen3: bias
    if name == "qwen3":
        assert "model.layers.1.self_attn.q_norm.weight" in names  # the anchor keeps its q/k norms
    if name == "gemma3":
        assert "model.layers.2.self_attn.q_norm.weight" in names and "lm_head.weight" not in names  # tied
        mlp_norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        assert {f"model.layers.3.{norm}.weight" for norm in mlp_norms} <= names


# ------------------------------------------------------------------------------------------- unsupported families
@pytest.mark.parametrize("model_type", ["gpt2", "mamba"])
def test_unsupported_model_type_is_refused_by_name(model_type, tiny_llama_dir, tmp_path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(model_type=model_type, architectures=["SomethingForCausalLM"])
    (tiny_llama_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", str(tiny_llama_dir), "--out", str(out)])
    assert result.exit_code == 2, result.output
    supported = (
        "llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), "
        "gemma3_text (Gemma3ForCausalLM)"
    )
    assert f"'{model_type}' model" in result.output and f"supports only: {supported}" in result.output
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ the family table
TABLE = import_remote("configuration_lisa").FAMILIES
ROOT = Path(__file__).resolve().parents[1]
# what reads the table and may name no family itself: the converter's families, the vLLM plugin (a family's own
# configuration file names its class, the Hub's entry point, and takes its model_type from the table)
READERS = [ROOT / "hfcompress" / "families" / "__init__.py", *(ROOT / "vllm-plugin" / "src" / "hfcompress_vllm").glob("*.py")]


@pytest.mark.parametrize("name", list(TABLE))
def test_each_family_of_the_table_builds_its_classes(name):
    """An entry of the table is a converter family with the same facts, whose remote config (model_type, attention
    types, biases, embedding scale) and causal LM load, and whose modeling has the norms the table states."""
    entry, family = TABLE[name], FAMILIES[name]
    assert {f: getattr(family, f) for f in vars(entry)} == vars(entry) and family.auto_map == entry.auto_map
    config_class, causal_lm = family.remote_classes()
    assert config_class.model_type == entry.converted_model_type and causal_lm.__name__ == entry.causal_lm_class
    original_config, original_class = family.transformers_classes()
    assert original_class.__name__ == entry.transformers_causal_lm and original_config.model_type in entry.model_types
    config = converted_config(original_config(**TINY, vocab_size=64), {})
    assert family_of(config) is family and config.lisa_family == entry and len(config.attention_types) == 4
    assert config.projection_biases["q_proj"] == (entry.biases == "qkv" or (entry.biases == "attention_bias" and config.attention_bias))
    assert (config.embedding_scale != 1.0) == entry.scaled_embedding
    modeling = family.modeling()  # its own classes name the norms the table states (the plugin builds those)
    own = [v for v in vars(modeling).values() if isinstance(v, type) and v.__module__ == modeling.__name__]
    norms = {vars(cls)["norm_class"].__name__ for cls in own if "norm_class" in vars(cls)}
    assert norms and all(("Gemma" in norm) == (entry.norm == "gemma") for norm in norms)
    assert entry.qk_norm == any("qk_norm_class" in vars(cls) for cls in own)


def test_the_family_table_is_the_only_source():
    """Every family of the table is the converter's (and nothing else is), a new entry would be too, and no reader of
    the table spells a family's model types or class names: they are the table's to say."""
    import ast
    import dataclasses

    import hfcompress.families as families

    assert list(FAMILIES) == list(TABLE)
    assert not [p.name for p in (ROOT / "hfcompress" / "families").glob("*.py") if p.name != "__init__.py"]
    new = dataclasses.replace(TABLE["llama"], name="llama9", title="Llama 9", model_types=("llama9",))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TABLE, "llama9", new)
        assert families._families()["llama9"].auto_map["AutoConfig"] == "configuration_lisa_llama9.LisaLlama9Config"
    names = {n for f in TABLE.values() for n in (*f.model_types, f.converted_model_type, f.config_class, f.causal_lm_class)}
    for path in READERS:
        spelled = {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
        assert not spelled & names, f"{path.relative_to(ROOT)} names {sorted(spelled & names)}: read the family table"
