"""hfcompress: LISA attention sharing + FASC low-rank compression for Llama, Mistral, Qwen2 and Qwen3 models on the Hub."""

import logging

__version__ = "0.1.0"

# torchao (the quantize extra, imported by transformers whenever it loads a model) logs that its CUDA-only extensions
# do not load on a CPU build, and torch one line per Enum it registers: noise on every command, not a fault
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
