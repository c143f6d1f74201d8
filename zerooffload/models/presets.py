"""The built-in GPT's shapes and presets, apart from the model so that the command line can list them
without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTConfig", "PRESETS"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level tokens: every byte value is a token."""
    block_size: int = 256
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd = {self.n_embd} must be a multiple of n_head = {self.n_head}")

    @property
    def num_params(self) -> int:
        """Parameters (the tied head counted once): 12·L·d² for the blocks plus embeddings and norms."""
        d, layers = self.n_embd, self.n_layer
        per_block = 12 * d * d + 13 * d
        return layers * per_block + (self.vocab_size + self.block_size) * d + 2 * d


PRESETS = {
    "nano": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),       # ~0.85M
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384),                       # ~10.8M
    "50m": GPTConfig(n_layer=7, n_head=12, n_embd=768),                        # ~50M
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024),    # ~0.30B
    "1b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=1024),      # ~1.2B
    "2b": GPTConfig(n_layer=32, n_head=24, n_embd=2304, block_size=1024),      # ~2.0B: bf16 model states ~33 GB
    "7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=1024),      # ~6.4B: bf16 model states ~90 GB
}
