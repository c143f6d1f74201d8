"""Hugging Face integration: ``Trainer`` (transformers' Trainer with the engine underneath),
``TrainingArguments`` (whose ``--deepspeed`` names the engine's config) and
``lazy_from_pretrained`` (a model larger than RAM, its weights streamed into the engine).

Needs ``pip install zerooffload[hf]`` (transformers, accelerate, safetensors)."""
from .lazy_model import hf_initializer, lazy_from_pretrained
from .trainer import EngineModule, Trainer
from .training_args import TrainingArguments

__all__ = ["Trainer", "TrainingArguments", "EngineModule", "lazy_from_pretrained", "hf_initializer"]
