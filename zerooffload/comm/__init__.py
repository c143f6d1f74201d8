"""Process groups and collectives: who shares a node (``topology``), the engine's groups and counters
(``group``), collectives that count what they move (``collectives``), and ZeRO++'s quantized ones
(``quantized``, over the int8/int4 block code of ``quantize``)."""
from ..errors import EngineGroupEnded
from .collectives import (ExchangeWork, all_gather, all_gather_object, all_reduce, barrier, broadcast,
                          control_all_reduce, reduce_scatter)
from .group import Comm, CommCounters, backend_for, end_group, end_process_groups, failing_together, init_comm
from .quantized import quantized_all_gather, quantized_reduce_scatter
from .topology import Topology, read_topology

__all__ = ["Comm", "CommCounters", "EngineGroupEnded", "ExchangeWork", "Topology", "init_comm", "read_topology",
           "failing_together", "end_group", "end_process_groups", "backend_for", "all_reduce", "reduce_scatter",
           "all_gather", "control_all_reduce", "broadcast", "barrier", "all_gather_object", "quantized_all_gather",
           "quantized_reduce_scatter"]
