"""Hugging Face integration: ``Trainer`` (transformers' Trainer with the engine underneath) and
``lazy_from_pretrained`` (a model larger than RAM, its weights streamed into the engine).

Needs ``pip install zerooffload[hf]`` (transformers, accelerate, safetensors)."""
from .lazy_model import hf_initializer, lazy_from_pretrained
from .trainer import EngineModule, Trainer

__all__ = ["Trainer", "EngineModule", "lazy_from_pretrained", "hf_initializer"]
