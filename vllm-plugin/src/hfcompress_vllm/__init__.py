"""vLLM plugin of hfcompress (the `hfcompress-vllm` distribution): serves `hfcompress convert` outputs (LisaLlama,
LisaMistral, LisaQwen2, LisaQwen3, LisaGemma3: every family of the remote code's family table,
`configuration_lisa.FAMILIES`) as native vLLM models, without trust_remote_code (docs/serving-vllm.md).

Registered through the `vllm.general_plugins` entry point (this distribution's pyproject.toml), which vLLM calls in
every engine process: `register()` gives transformers the converted config classes (model_type "lisa_<family>") and
vLLM the causal-LM architectures (lazily: the model module is imported by vLLM only when such a model is loaded).
Importing this package imports neither vllm nor torch. It never imports `hfcompress` (the converter): the two
distributions install into different environments (their transformers ranges do not overlap).
"""

# one version for both distributions: a model's config.json records the converter's (`hfcompress_version`) and this
# plugin serves only its own (versions.check_converter); hfcompress/__init__.py carries the same number
__version__ = "0.1.0"


def register() -> None:
    """vLLM's entry point: the converted config classes for transformers, the architectures for vLLM."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .configs import CONFIG_CLASSES, FAMILIES

    for model_type, config_class in CONFIG_CLASSES.items():
        try:
            AutoConfig.register(model_type, config_class)
        except ValueError:  # already registered in this process
            pass
    supported = set(ModelRegistry.get_supported_archs())
    for family in FAMILIES.values():  # config.json "architectures" names the family's causal-LM class
        arch = family.causal_lm_class
        if arch not in supported:
            ModelRegistry.register_model(arch, f"hfcompress_vllm.model:{arch}")


def exit_cleanly(llm) -> None:
    """End a process that ran a vLLM `LLM` with exit status 0, once its results are written: stop the engine-core
    process, then leave without the interpreter's teardown, where vLLM's background threads can abort the process
    ("terminate called without an active exception", SIGABRT) and turn finished work into a failure."""
    import os
    import sys

    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
