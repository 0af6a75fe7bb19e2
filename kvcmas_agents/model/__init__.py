"""The model: a Llama-family forward over plain weight tensors, its arguments and RoPE, checkpoint
loading (and seeded random models), sampling, and plain attention primitives."""
from .args import ModelArgs
from .llama import AttentionBackend, LlamaModel
from .loader import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["DEFAULT_MODEL", "AttentionBackend", "LlamaModel", "LoadedModel", "ModelArgs", "load_model"]
