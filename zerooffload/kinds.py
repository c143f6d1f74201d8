"""What a tensor held by a tier is for (``tiers``' [Note: tiers and kinds]).

Its own module so that what works through tiers (``block_stream``) can name a kind without importing
the tiers themselves; ``tiers`` re-exports it.
"""
from __future__ import annotations

import enum

__all__ = ["Kind"]


class Kind(enum.Enum):
    PARAM = "param"
    """Parameters in the compute dtype: full, or this rank's shard."""
    GRAD = "grad"
    """Gradients in the compute dtype: full, or this rank's shard."""
    OPTIMIZER = "optimizer"
    """fp32 master weights (when separate from the parameters) and optimizer moments."""
    GATHERED = "gathered"
    """Stage 3: full parameters of units gathered for compute (bounded by ``zero.max_live_size``)."""
    SECONDARY = "secondary"
    """Stage 3 with hpZ: each partitioned unit's secondary shard, a 1/N share of its gathered parameters kept
    from its first gather in a training pass to the pass's end (``zero.gathers``' [Note: secondary shards])."""
    BUFFER = "buffer"
    """Engine temporaries: gradients of a unit being reduced, reduce-scatter outputs, staging."""
    ACTIVATION = "activation"
    """Checkpointed block inputs waiting off the device for backward (``offload.activations.tier``)."""
