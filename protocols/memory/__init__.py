"""An in-memory federation: many nodes, one process, one event loop.

network.py  the hub (`InMemoryNetwork`) and one node's `RoundContext` over it
            (`InMemoryContext`), with fault injection and traffic counting
nodes.py    what the hub keeps of each node (`MemoryNode`) and its `Traffic`
simulate.py `simulate(configs)` runs every site's protocol concurrently;
            `simulation_configs` builds their configs
results.py  `SimulationResult`: per node per round records (macro_f1, accuracy,
            messages_sent, bytes_sent, train_s, round_s, ...), neighbour
            choices and traffic
ray_engine.py  `simulate(..., engine="ray")`: the same, the nodes sharded over
            Ray actors; the driver's side
ray_actor.py   the shard actor (`Shard`): its methods, progress reads included
ray_shard.py   a shard's part of the network (ray_engine.py and this are the
            only modules that import ray, lazily)
ray_mail.py    what one shard sends another, batched per short window (no ray)
"""

from .network import InMemoryContext, InMemoryNetwork
from .nodes import KindTraffic, Traffic
from .results import SimulationResult
from .simulate import simulate, simulation_configs

__all__ = [
    "InMemoryContext",
    "InMemoryNetwork",
    "KindTraffic",
    "SimulationResult",
    "Traffic",
    "simulate",
    "simulation_configs",
]
