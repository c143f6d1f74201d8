"""The Trainer's ``checkpoint-N`` folders with the engine's checkpoint inside: which one a resume
takes, the global batch it keeps, and which old ones ``save_total_limit`` removes.

[Note: Trainer checkpoints]
- ``checkpoint-N/`` holds the plain Trainer's layout with ``zerooffload.json`` (its files' sizes and
  CRC32Cs, the counters, the run's shape: world size, micro-batch, accumulation; trainer_files' note),
  or the engine's checkpoint in ``zerooffload/`` (manifest, checksummed rank files, ``latest``; the run's
  shape in its client state); a plain Trainer's own has neither record.
- ``resume_from_checkpoint=True`` takes the newest ``checkpoint-N`` that verifies (sizes, CRCs; a plain
  Trainer's has nothing to verify it with: taken as it is); when that is not the newest, one line says
  which was passed over and why. A
  folder a save or a prune left half-written never looks complete: the engine publishes its tag
  last, and a pruned folder is renamed ``checkpoint-N.partial`` before it is removed; every save
  removes such leftovers (checkpoint.pruning's [Note: one pruning rule], shared with train's
  ``--keep-last``). A ``checkpoint-N`` that is a symbolic link is refused, never written through
  nor removed.
- At another world size the accumulation becomes saved global batch / (world × micro-batch), so every
  optimizer step sees the same samples (Accelerate deals rank r the batches r, r + world, ...) and
  the same loss normalization; a global batch that does not divide is refused with the numbers.
- ``save_total_limit`` keeps the newest that many (the one just saved among them), and never removes
  the best checkpoint (the Trainer keeps it too) or the last saved before a streak of skipped windows began
  (run_checkpoints' [Note: pruning]: the saves during a streak hold no newer model).
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, first_verified, pruning, read_manifest, series
from ..checkpoint.by_name import PARAM, NamedSource, Request
from .trainer_files import MODEL_FILE, OPTIMIZER_FILE, read_digests

__all__ = ["ENGINE_DIR", "check_links", "run_shape", "global_batch_for", "newest_loadable", "prune_checkpoints",
           "folder_kind", "is_trainer_layout", "trainer_layout_source"]

ENGINE_DIR = "zerooffload"
"""The engine's checkpoint inside each checkpoint-N."""

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
"""transformers' PREFIX_CHECKPOINT_DIR and its step number."""


def run_shape(args: Any) -> dict:
    """The client state each save records: what a resume needs to keep the global batch."""
    return {"world_size": args.world_size, "micro_batch_size": args.per_device_train_batch_size,
            "grad_accum_steps": args.gradient_accumulation_steps}


def global_batch_for(checkpoint: Path, args: Any) -> int:
    """The accumulation that gives ``args``' world size and micro-batch the saved global batch (a plain
    Trainer's checkpoint does not record it: the arguments' own)."""
    if folder_kind(checkpoint) == "trainer":
        saved = (read_digests(checkpoint, verify=False) or {}).get("client_state") or {}
    else:
        saved = read_manifest(checkpoint / ENGINE_DIR, verify=False).data.get("client_state") or {}
    if not saved:
        return args.gradient_accumulation_steps
    total = saved["world_size"] * saved["micro_batch_size"] * saved["grad_accum_steps"]
    per_step = args.world_size * args.per_device_train_batch_size
    if total % per_step:
        raise CheckpointError(
            f"{checkpoint} was saved with a global batch of {total} (world size {saved['world_size']} × "
            f"per_device_train_batch_size {saved['micro_batch_size']} × gradient_accumulation_steps "
            f"{saved['grad_accum_steps']}); world size {args.world_size} × per_device_train_batch_size "
            f"{args.per_device_train_batch_size} does not divide it: choose a micro-batch that does")
    return total // per_step


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """``checkpoint-N`` folders, oldest first by N (a link among them is refused)."""
    return [run_dir / name for name in series(run_dir, _CHECKPOINT)]


def newest_loadable(run_dir: Path, rank: int) -> str:
    """The newest checkpoint-N that verifies ([Note: Trainer checkpoints])."""
    folders = checkpoint_folders(run_dir)[::-1]
    if not folders:
        raise CheckpointError(f"no checkpoint-N folder in {run_dir} to resume from: train without "
                              "resume_from_checkpoint, or pass the output_dir of the run to continue")
    found, errors = first_verified([(folder, None) for folder in folders], verify=_verify_folder)
    if found is None:
        raise CheckpointError(f"no checkpoint in {run_dir} verifies: {folders[0].name}: {errors[0]}; "
                              "train without resume_from_checkpoint, or restore the files")
    if errors and rank == 0:
        print(f"zerooffload: warning: not resuming from {folders[0].name} ({errors[0]}); resuming from "
              f"{folders[found].name}, the newest checkpoint that verifies", file=sys.stderr)
    return str(folders[found])


def _verify_folder(folder: Path, _tag: None) -> None:
    """A checkpoint-N's files checked against its record: ours in the Trainer's layout (zerooffload.json; a
    plain Trainer's has none, taken as it is), or the engine's manifest."""
    if is_trainer_layout(folder):
        read_digests(folder, verify=True)
    else:
        read_manifest(folder / ENGINE_DIR)


def prune_checkpoints(run_dir: Path, limit: int | None, spare: set[str | None]) -> None:
    """After every save: remove ``checkpoint-N.partial`` leftovers and the checkpoint-N folders older
    than the newest ``limit`` (None or 0: none), sparing ``spare`` (paths of folders in ``run_dir``).
    The one just saved, which verified as it was written, is the newest: always kept."""
    pruning.prune(run_dir, _CHECKPOINT, limit or 0, {Path(p).name for p in spare if p})


def check_links(run_dir: Path) -> None:
    """Before a save: a link among the checkpoint-N names (the one about to be written, those a prune
    would remove, and their leftovers) is refused, never written through nor removed."""
    series(run_dir, _CHECKPOINT)


# ---------------------------------------------------------------------------------------------- the Trainer's own layout
def is_trainer_layout(folder: Path) -> bool:
    """A checkpoint-N in the plain Trainer's layout (weights and AdamW state_dict; the plain Trainer's or
    ours), not the engine's sharded one."""
    return not (folder / ENGINE_DIR).is_dir() and (folder / MODEL_FILE).is_file() and (folder / OPTIMIZER_FILE).is_file()


def folder_kind(folder: Path) -> str:
    """``"engine"`` (ours: ``zerooffload/`` inside) or ``"trainer"`` (the plain Trainer's layout); anything
    else is refused saying what a resume needs."""
    if is_trainer_layout(folder):
        return "trainer"
    if (folder / ENGINE_DIR).is_dir():
        return "engine"
    raise CheckpointError(f"{folder}: neither a zerooffload Trainer checkpoint ({ENGINE_DIR}/) nor a plain Trainer's "
                          f"({MODEL_FILE} and {OPTIMIZER_FILE}): pass a checkpoint-N folder a Trainer saved")


def trainer_layout_source(folder: Path, groups: list[list[str]]) -> NamedSource:
    """``by_name``'s source over a plain Trainer's checkpoint-N: ``model.safetensors`` read by row ranges,
    ``optimizer.pt`` (torch.optim.AdamW's state_dict, memory-mapped) whose parameter indices are the plain
    Trainer's groups in order, ``groups`` (names: weight decay, then none; ``Trainer._param_groups``)."""
    from safetensors import safe_open

    weights = safe_open(str(folder / MODEL_FILE), framework="pt")
    saved = torch.load(folder / OPTIMIZER_FILE, mmap=True, weights_only=True)
    names = _indexed_names(folder, saved, groups)
    state = {names[index]: values for index, values in saved["state"].items()}
    settings = {names[i]: {k: v for k, v in group.items() if k != "params"}
                for group in saved["param_groups"] for i in group["params"]}
    stored = set(weights.keys())

    def read(requests: list[Request]) -> None:
        for request in requests:
            if request.kind == PARAM:
                name = next((n for n in request.names if n in stored), None)
                if name is None:
                    raise CheckpointError(f"{folder / MODEL_FILE}: no tensor for {request.names[0]} (nor its tied names)")
                piece = weights.get_slice(name)
                row = math.prod(piece.get_shape()[1:])
                lo, hi = request.start // row, -(-request.stop // row)
                values = piece[lo:hi].reshape(-1) if piece.get_shape() else weights.get_tensor(name).reshape(-1)
                request.out.copy_(values[request.start - lo * row:request.stop - lo * row])
            else:
                moments = next((state[n] for n in request.names if n in state), None)
                if moments is not None and request.kind in moments:
                    request.out.copy_(moments[request.kind].reshape(-1)[request.start:request.stop])

    steps = {name: float(values["step"]) for name, values in state.items() if "step" in values}
    buffers = {name: weights.get_tensor(name) for name in stored if name not in names.values()}
    return NamedSource(read, steps, settings, buffers)


def _indexed_names(folder: Path, saved: dict, groups: list[list[str]]) -> dict[int, str]:
    """optimizer.pt's parameter indices -> names, checked: the same groups of the same sizes."""
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    if sizes != [len(names) for names in groups]:
        raise CheckpointError(f"{folder / OPTIMIZER_FILE}: parameter groups of {sizes} parameters, but this model's "
                              f"Trainer groups (weight decay, none) hold {[len(n) for n in groups]}: saved from another "
                              "model or another optimizer setup")
    return {index: name for group, names in zip(saved["param_groups"], groups) for index, name in
            zip(group["params"], names)}
