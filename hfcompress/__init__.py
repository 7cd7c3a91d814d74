"""hfcompress: LISA attention sharing + FASC low-rank compression for Llama, Mistral, Qwen2 and Qwen3 models on the Hub."""

__version__ = "0.1.0"
