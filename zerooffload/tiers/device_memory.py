"""A device budget CUDA itself enforces: what the budget covers besides the engine's tensors, and the cap.

[Note: a budget CUDA enforces]
``memory.device_budget`` set to a size is all the GPU memory the process may use, as if the GPU had that
much (a 24 GiB card's worth on a 141 GB H200, or a share of a GPU used by others). Two things hold it:
- *The check* (``check_plan``, the engine's start and every layout ``plan`` weighs) holds the engine's
  tensors and the measured activations to the budget less what the process holds besides them
  (``outside_tensors``): the CUDA context, which the driver keeps outside torch's allocator, and
  cuBLAS's workspaces, which torch takes from its caching allocator (one per handle and stream:
  ``cublas_workspace_bytes``). The context is measured where this process has not made it yet
  (``note_context``: NVML's used memory before, ``mem_get_info`` after); a process that made it earlier
  (an import that touched CUDA) counts ``CONTEXT_ESTIMATE`` instead.
- *The cap* (``cap_allocator``, at ``initialize``): torch's caching allocator may reserve at most the
  budget less the context (``torch.cuda.set_per_process_memory_fraction``). What the check could not
  foresee (fragmentation, a kernel's scratch, a leak) ends in CUDA's out-of-memory error, which the
  command line reports in one line naming ``memory.device_budget`` (``out_of_budget_line``), instead of
  the run taking the rest of the GPU unnoticed.
``"auto"`` (90% of the memory free once the context exists) sets no cap: the GPU's own size is the limit
there, and an engine made with it lifts a cap an earlier engine of the process set. On a CPU device the
budget is RAM accounted against it, as it always was: nothing here applies.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

__all__ = ["CONTEXT_ESTIMATE", "cap_allocator", "context_bytes", "cublas_workspace_bytes", "note_context",
           "out_of_budget_line", "outside_tensors"]

CONTEXT_ESTIMATE = 1 << 30
"""Bytes taken for the CUDA context where it could not be measured: an estimate, not a measurement of this
project's (a CUDA 12 context with lazily loaded modules is commonly reported at 0.3-0.6 GB on Hopper parts,
and grows as kernels load), taken high so that a budget it stands in is not passed;
``bench/gpu_workstation.py`` records the measured one."""
_CONTEXTS: dict[int, int] = {}
"""Measured context bytes by device index (``note_context``)."""
_CAPS: dict[int, tuple[int, int]] = {}
"""The budget and the allocator's cap set per device index (``cap_allocator``)."""


def note_context(index: int) -> None:
    """Measure the CUDA context of device ``index`` as this process makes it (see the note): NVML's used
    memory before, ``mem_get_info``'s after; nothing when torch has made it already, when NVML cannot be
    read, or when there is no CUDA. Call before anything touches the device."""
    if index in _CONTEXTS or not torch.cuda.is_available() or torch.cuda.is_initialized():
        return
    try:
        before = torch.cuda.device_memory_used(index)  # NVML's: makes no context
    except Exception:  # noqa: BLE001  no NVML (nvidia-ml-py missing, a driver without it): the estimate stands
        return
    free, total = torch.cuda.mem_get_info(index)  # makes the context
    _CONTEXTS[index] = max(0, total - free - before - torch.cuda.memory_reserved(index))


def context_bytes(device: torch.device) -> int:
    """The CUDA context's bytes on ``device``: measured (``note_context``) or ``CONTEXT_ESTIMATE``."""
    return _CONTEXTS.get(_index(device), CONTEXT_ESTIMATE)


def cublas_workspace_bytes(device: torch.device) -> int:
    """cuBLAS's workspaces in torch's allocator: ``CUBLAS_WORKSPACE_CONFIG``'s ``:KiB:count`` pairs, else
    torch's default (32 MiB on compute capability 9 and later, ``:4096:2:16:8`` before), for two handles
    (cuBLAS's and cuBLASLt's) on the one stream the compute runs on."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        one = sum(int(kib) * int(count) for kib, count in pairs) << 10
    else:
        major = 9  # the larger default where the device cannot be asked (a plan for numbers given)
        with contextlib.suppress(Exception):
            major = torch.cuda.get_device_properties(_index(device)).major
        one = 32 << 20 if major >= 9 else (4096 * 2 + 16 * 8) << 10
    return 2 * one


def outside_tensors(device: torch.device) -> int:
    """Bytes of a CUDA device's budget the engine's tensors cannot have (see the note)."""
    return context_bytes(device) + cublas_workspace_bytes(device)


def cap_allocator(device_budget: int | str, device: torch.device) -> None:
    """Cap torch's caching allocator on a CUDA ``device`` at ``device_budget`` less the context (see the
    note); lift any cap for ``"auto"``. Nothing on a CPU device."""
    if device.type != "cuda":
        return
    index = _index(device)
    if device_budget == "auto":
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        _CAPS.pop(index, None)
        return
    _, total = torch.cuda.mem_get_info(index)
    cap = int(device_budget) - context_bytes(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(cap, 0) / total), index)
    _CAPS[index] = (int(device_budget), cap)


def out_of_budget_line(error: BaseException) -> str | None:
    """One line for CUDA's out-of-memory ``error`` where a budget capped the allocator (``cap_allocator``):
    what passed the budget and what to change; None for any other error (no cap: the GPU was full)."""
    if not isinstance(error, torch.OutOfMemoryError) or not _CAPS:
        return None
    budget, cap = next(iter(_CAPS.values())) if len(_CAPS) == 1 else _CAPS[torch.cuda.current_device()]
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", str(error))
    what = "CUDA out of memory" + (f" allocating {asked.group(1)}" if asked else "")
    return (f"{what}: past memory.device_budget = {budget:,} bytes (torch's allocator capped at {cap:,}, the budget "
            "less the CUDA context); raise memory.device_budget, keep less on the device (train --plan auto "
            "chooses: offload.*.tier, offload.activations.tier = \"host\", train.activation_checkpointing), or "
            "lower train.micro_batch_size")


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    with contextlib.suppress(Exception):
        return torch.cuda.current_device()
    return 0
