"""The placement engine: pure, synchronous, deterministic.

Owns the model of the cluster's GPUs (`inventory`), what a pod asks for
(`requests`), who holds which share of which GPU (`ledger`), whether and how a
request fits a node (`fit`), how fragmented a node is against the typical
workload (`fragmentation`), the scoring policies (`policies`), the choice of a
node across the cluster (`choosing`), all-or-nothing plans for gangs (`gangs`),
and trace replay (`trace`, `replay`). The queue engine is its sub-room `queueing`
(quota in GPU units, admission rounds, reclaim, elastic gangs, fair entitlements,
capacity holds, the replay in time), pure as the rest.

It must never do I/O, read a clock, log, read or write wire bytes (JSON: the
extender's wire, with its C helpers, is the extender's), or import asyncio, aiohttp,
kubernetes_asyncio, prometheus_client, pydantic or any other gpuplace room: the
import-linter contracts in pyproject.toml keep it so.
"""
