"""Built-in models: the GPT (``gpt``) and its presets (``presets``, importable without torch)."""
from .presets import PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]


def __getattr__(name: str):
    if name == "GPT":  # loads torch: only when the model is wanted
        from .gpt import GPT
        return GPT
    raise AttributeError(f"module 'zerooffload.models' has no attribute {name!r}")
