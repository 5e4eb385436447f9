"""`kvindex.sim`: a simulated vLLM fleet that publishes real KV-cache events.

- `Simulation`: the workload model (engines with bounded block pools, prefix caching, a CPU
  tier, LoRA, restarts and resets) as a deterministic stream of encoded batches, no sockets;
  its `reference()` is what each engine's pool holds (the truth an index must match).
- `SimulatedPublishers`: the same, published by vLLM-compatible PUB + ROUTER sockets at a
  target rate (`kvindex simulate`, `kvindex demo`).
"""

from kvindex.sim.encoding import FORMATS, HASH_KINDS, HashKind, WireFormat, encode_step
from kvindex.sim.live import PortsBusy, SimulatedPublishers, free_port_run
from kvindex.sim.simulation import (
    Reference,
    SimBatch,
    SimConfig,
    SimItem,
    SimRestart,
    Simulation,
    payloads,
)
from kvindex.sim.workload import WorkloadShape

__all__ = [
    "FORMATS",
    "HASH_KINDS",
    "HashKind",
    "PortsBusy",
    "Reference",
    "SimBatch",
    "SimConfig",
    "SimItem",
    "SimRestart",
    "SimulatedPublishers",
    "Simulation",
    "WireFormat",
    "WorkloadShape",
    "encode_step",
    "free_port_run",
    "payloads",
]
