"""hfcompress: LISA attention sharing + FASC low-rank compression for Llama, Mistral, Qwen2, Qwen3 and Gemma 3 models on
the Hub."""

import logging

# the package version (pyproject.toml reads it here); the vLLM plugin (vllm-plugin/, hfcompress-vllm) carries the same
# number and serves the models this version writes (config.json's hfcompress_version, build.converted_config)
__version__ = "0.1.0"

# torchao (the quantize extra, imported by transformers whenever it loads a model) logs that its CUDA-only extensions
# do not load on a CPU build, and torch one line per Enum it registers: noise on every command, not a fault
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
