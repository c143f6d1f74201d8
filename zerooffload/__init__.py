"""zerooffload: ZeRO sharded data-parallel training with a CPU/NVMe offload engine.

The public names are listed in ``__all__``; DESIGN §2 and README.md describe their contract.
"""
from .threads import choose_openmp_wait

choose_openmp_wait()  # before anything loads torch: libgomp reads its settings once (threads' note)

from . import checkpoint  # noqa: E402
from .checkpoint import CheckpointError  # noqa: E402
from .config import Config, ConfigError  # noqa: E402
from .deepspeed_config import DeepSpeedConfigWarning  # noqa: E402
from .engine import Engine, initialize  # noqa: E402
from .lazy_init import init_context  # noqa: E402
from .pretrained import load_safetensors  # noqa: E402

__version__ = "0.1.0"
__all__ = ["CheckpointError", "Config", "ConfigError", "DeepSpeedConfigWarning", "Engine", "checkpoint", "init_context", "initialize", "load_safetensors",
           "__version__"]
