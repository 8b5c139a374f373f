"""sglang-cp: context-parallel tiered KV cache for SGLang (plugin)."""

__version__ = "0.1.0"
