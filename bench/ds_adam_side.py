#!/usr/bin/env python3
"""DeepSpeed's side of ``zerooffload bench adam``: DeepSpeedCPUAdam(adamw_mode=True) steps, each followed
by the copy of the updated fp32 params into preallocated low-precision tensors (the phase an offloaded
mixed-precision step must do, as shared/anchors/adam_bench.py measures it).

Runs inside the DeepSpeed venv (``DS_ACCELERATOR=cpu``), as a long-lived child of the bench, so that
importing deepspeed (~4 s), loading its cpu_adam op (built on first use, ~40 s) and allocating the
tensors happen once, outside every timing. Protocol, one line each way:
  stdin  ``step`` | ``quit``
  stdout ``{"ms": T}``: one optimizer step plus the copies, timed here (no pipe in the timing)
The first line it prints is ``{"ready": true}``, or ``{"error": "..."}`` when the op will not load.
By hand: ``printf 'step\\nstep\\nquit\\n' | DS_ACCELERATOR=cpu /tmp/anchors/dsvenv/bin/python
bench/ds_adam_side.py --params 20000000``. Not a test and not part of the package: nothing imports it.
"""
import argparse
import json
import sys
import time


def reply(**fields):
    print(json.dumps(fields), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, required=True, help="parameters in all")
    ap.add_argument("--tensor-numel", type=int, default=10_000_000, help="elements per tensor (the last may be fewer)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="dtype of the copies")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    args = ap.parse_args()
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        sizes = [min(args.tensor_numel, args.params - start) for start in range(0, args.params, args.tensor_numel)]
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        for p in params:
            p.grad = torch.randn(p.numel(), generator=gen) * 1e-3
        optimizer = DeepSpeedCPUAdam(params, lr=args.lr, weight_decay=args.weight_decay, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips this side
        reply(error=f"DeepSpeedCPUAdam does not load: {type(exc).__name__}: {exc}")
        return 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    copies = [torch.empty(n, dtype=dtype) for n in sizes]
    reply(ready=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        start = time.perf_counter()
        optimizer.step()
        for copy, p in zip(copies, params):
            copy.copy_(p.detach())
        reply(ms=(time.perf_counter() - start) * 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
