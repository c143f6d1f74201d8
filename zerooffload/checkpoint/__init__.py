"""Checkpoints: ``sharded`` (save, load, reshard, consolidate), ``layout`` (the manifest, and reading
saved values by parameter name) and ``files`` (atomic publication of a tag, checksummed writes)."""
from .files import LATEST, PARTIAL, CheckpointError, ChecksummedWriter
from .layout import Manifest, read_manifest
from .sharded import consolidate, default_tag, load_checkpoint, persistent_buffers, resolve_tag, save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "Manifest", "persistent_buffers", "ChecksummedWriter", "LATEST", "PARTIAL"]
