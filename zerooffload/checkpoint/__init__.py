"""Checkpoints: ``sharded`` (save, load, reshard, consolidate), ``layout`` (the manifest, and reading
saved values by parameter name), ``files`` (atomic publication of a tag, checksummed writes),
``pruning`` (which old checkpoints of a series go), ``dcp`` (torch.distributed.checkpoint
directories in and out, and ``load_checkpoint``, which tells the kinds apart), ``by_name`` (state from
another framework's checkpoint by parameter name), ``safetensors_file`` (one safetensors file
written tensor by tensor), ``saving`` (a save begun at a step boundary, then finished) and ``async_save``
(saves finished in the background, their handles)."""
from .async_save import SaveHandle, Saves
from .files import (LATEST, PARTIAL, CheckpointError, ChecksummedWriter, StagingRing, read_latest, refuse_links,
                    remove_tree)
from .layout import Manifest, first_verified, read_manifest
from .pruning import prune, series
from .safetensors_file import SafetensorsEntry, save_safetensors, write_safetensors
from .dcp import export_dcp, is_dcp, load_checkpoint
from .sharded import consolidate, default_tag, persistent_buffers, resolve_tag, save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "first_verified", "Manifest", "persistent_buffers", "ChecksummedWriter", "LATEST",
           "PARTIAL", "read_latest", "refuse_links", "remove_tree", "prune", "series", "SafetensorsEntry",
           "save_safetensors", "write_safetensors", "SaveHandle", "Saves", "StagingRing", "export_dcp", "is_dcp"]
