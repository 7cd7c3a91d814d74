"""Running a converted model beyond plain transformers: weight-only quantization of the written model and the quantized
KV-cache backends (quantize), and `hfcompress eval --engine vllm` through the separately installed hfcompress-vllm
plugin (vllm_engine)."""
