"""zerooffload: ZeRO sharded data-parallel training with a CPU/NVMe offload engine.

The public names are listed in ``__all__``; DESIGN §2 and README.md describe their contract.
"""
from . import checkpoint
from .checkpoint import CheckpointError
from .config import Config, ConfigError
from .deepspeed_config import DeepSpeedConfigWarning
from .engine import Engine, initialize
from .lazy_init import init_context
from .pretrained import load_safetensors

__version__ = "0.1.0"
__all__ = ["CheckpointError", "Config", "ConfigError", "DeepSpeedConfigWarning", "Engine", "checkpoint", "init_context", "initialize", "load_safetensors",
           "__version__"]
