"""Built-in models: a GPT in plain PyTorch with presets from ~1M to ~2B parameters."""
from .gpt import GPT, GPTConfig, PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS"]
