"""Several processes: the host work shared by data-parallel ranks and FSDP2's sharded parameters.

Owns `sharding.py` (DDP: each rank's share of every offloaded matrix, `RankGroup` and its batched collectives),
`fsdp.py` (FSDP2: `LocalShards`, the DTensor parameters and their local shards, the global gradient norm) and
`replica_check.py` (the notice when several processes would each hold the whole host state).

May import: `transport`, `settings`, `hf_zenflow._base`. It knows tensors, process groups and DTensors, not the
engine's types: the engine (above) keys its state by what `LocalShards` hands it and shares its host work through
`RankGroup`.
"""
