"""The GPT model with optional MoE layers; `create_model` builds on meta and initialises deterministically."""

from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel, GPTOutput, create_model
from moetron.model.kv_cache import KVCache

__all__ = ["GPTModel", "GPTOutput", "KVCache", "ModelConfig", "create_model"]
