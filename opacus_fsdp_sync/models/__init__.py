"""Model presets (Llama) built without downloads."""

from .llama import PRESETS, TASKS, LlamaSpec, build_llama, count_parameters, decoder_layers

__all__ = ["PRESETS", "TASKS", "LlamaSpec", "build_llama", "count_parameters", "decoder_layers"]
