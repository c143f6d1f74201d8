"""Checkpoints: ``sharded`` (save, load, reshard, consolidate), ``layout`` (the manifest, and reading
saved values by parameter name), ``files`` (atomic publication of a tag, checksummed writes) and
``safetensors_file`` (one safetensors file written tensor by tensor)."""
from .files import LATEST, PARTIAL, CheckpointError, ChecksummedWriter, remove_tree
from .layout import Manifest, first_verified, read_manifest
from .safetensors_file import SafetensorsEntry, save_safetensors, write_safetensors
from .sharded import consolidate, default_tag, load_checkpoint, persistent_buffers, resolve_tag, save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "first_verified", "Manifest", "persistent_buffers", "ChecksummedWriter", "LATEST",
           "PARTIAL", "remove_tree", "SafetensorsEntry", "save_safetensors", "write_safetensors"]
