#!/usr/bin/env python3
"""DeepSpeed's side of ``io_vs_fio.py``: its aio handle (libaio, O_DIRECT) writing and reading one file.

Runs inside the DeepSpeed venv (``DS_ACCELERATOR=cpu``), as a long-lived child of io_vs_fio.py, so
that importing deepspeed (~4 s) and allocating the locked buffers happen once, outside every timing,
as they do for the in-process sides. Protocol, one line each way:
  stdin  ``write PATH`` | ``read PATH`` | ``quit``
  stdout ``{"seconds": S}`` (write: sync_pwrite + os.fsync; read: sync_pread, then checked byte for
         byte against what this process last wrote) or ``{"error": "..."}``
The first line it prints is ``{"ready": true}``, or ``{"error": ...}`` when the op will not load.
Not a test and not part of the package: nothing imports it.
"""
import argparse
import json
import os
import sys
import time


def reply(**fields):
    print(json.dumps(fields), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="intra_op_parallelism")
    args = ap.parse_args()
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips this side
        reply(error=f"DeepSpeed async_io does not load: {type(exc).__name__}: {exc}")
        return 1
    handle = aio.aio_handle(block_size=args.block_size, queue_depth=args.queue_depth, single_submit=False,
                            overlap_events=True, intra_op_parallelism=args.threads)
    template = torch.empty(0, dtype=torch.uint8)
    payload = handle.new_cpu_locked_tensor(args.bytes, template)
    readback = handle.new_cpu_locked_tensor(args.bytes, template)
    payload.random_(0, 256, generator=torch.Generator().manual_seed(1))
    reply(ready=True)
    for line in sys.stdin:
        op, _, path = line.strip().partition(" ")
        if op == "quit":
            break
        if op == "write":
            payload.add_(1)  # new bytes each time: a write that moved nothing would read back stale
            start = time.perf_counter()
            status = handle.sync_pwrite(payload, path)
            fd = os.open(path, os.O_RDONLY)  # the handle opens and closes its own descriptor
            os.fsync(fd)
            seconds = time.perf_counter() - start
            os.close(fd)
        else:
            readback.zero_()
            start = time.perf_counter()
            status = handle.sync_pread(readback, path)
            seconds = time.perf_counter() - start
            if not torch.equal(payload, readback):
                reply(error=f"read back differs from what was written in {path}")
                continue
        if status < 0:
            reply(error=f"{op} {path} returned {status}")
        else:
            reply(seconds=seconds)
    handle.free_cpu_locked_tensor(payload)
    handle.free_cpu_locked_tensor(readback)
    return 0


if __name__ == "__main__":
    sys.exit(main())
