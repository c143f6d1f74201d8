"""What the forkserver the rank pools fork from imports once, for every rank (harness's [Note: rank pool]).

zerooffload comes first: it sets OpenMP's waiting before torch loads libgomp (zerooffload.threads' note).
torch._dynamo is what makes a fresh process's first engine slow: torch.optim.Optimizer's constructor
imports it (~5 s on a 2-core CI), per rank, per pool started. The engine is imported if it imports: a
rank that needs a broken one meets the error itself, in its task, with its traceback.
"""
import zerooffload  # noqa: F401  (first, see above)

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

import zerooffload.log  # noqa: F401

try:
    import zerooffload.engine  # noqa: F401
except Exception:  # noqa: BLE001 -- reported by the task that needs it, not here
    pass
