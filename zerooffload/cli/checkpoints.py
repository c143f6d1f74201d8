"""``zerooffload checkpoint consolidate | export``: a saved checkpoint as one safetensors file, or as a
torch.distributed.checkpoint directory that FSDP2 loads (checkpoint.dcp's [Note: DCP checkpoints])."""
from __future__ import annotations

import argparse

from ..errors import CheckpointError

__all__ = ["add_checkpoint"]


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate
    from ..precision import COMPUTE_DTYPES

    try:
        path = consolidate(args.checkpoint, args.out, COMPUTE_DTYPES[args.dtype], args.tag)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; consolidate another tag with --tag NAME") from exc
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..checkpoint import export_dcp

    path = export_dcp(args.checkpoint, args.out, args.tag)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"wrote {path} ({size / 1e6:.1f} MB): load it with dcp.load({{\"model\": ..., \"optim\": ...}}) and "
          "set_state_dict")
    return 0


def add_checkpoint(commands: argparse._SubParsersAction) -> None:
    checkpoint = commands.add_parser("checkpoint", help="work with saved checkpoints")
    kinds = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="WHAT")
    merge = kinds.add_parser("consolidate", help="write a checkpoint's model as one safetensors file")
    merge.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (holding 'latest' and tags)")
    merge.add_argument("out", metavar="OUT.safetensors", help="the safetensors file to write")
    merge.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype (default fp32)")
    merge.add_argument("--tag", help="tag to read (default: the one 'latest' names)")
    merge.set_defaults(run=_cmd_consolidate)
    export = kinds.add_parser("export", help="write a checkpoint's model and optimizer state in another format")
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (holding 'latest' and tags)")
    export.add_argument("out", metavar="DIR", help="the directory to write (new or empty)")
    export.add_argument("--format", choices=("dcp",), required=True,
                        help="dcp: a torch.distributed.checkpoint directory in FSDP2's get_state_dict layout")
    export.add_argument("--tag", help="tag to read (default: the one 'latest' names)")
    export.set_defaults(run=_cmd_export)
