"""The placement engine: pure, synchronous, deterministic.

Owns the model of the cluster's GPUs (`inventory`), what a pod asks for
(`requests`), who holds which share of which GPU (`ledger`), whether and how a
request fits a node (`fit`), how fragmented a node is against the typical
workload (`fragmentation`), the scoring policies (`policies`), the choice of a
node across the cluster (`choosing`), all-or-nothing plans for gangs (`gangs`),
queues (quota in GPU units: `quotas`; admission rounds: `admitting`; preemption to get
back lent quota: `reclaiming`; elastic gangs: `elastic`; fair entitlements: `fairness`),
and trace replay (`trace`, `replay`; in time, with or without queues: `timeline`).

It must never do I/O, read a clock, log, read or write wire bytes (JSON: the
extender's wire, with its C helpers, is the extender's), or import asyncio, aiohttp,
kubernetes_asyncio, prometheus_client, pydantic or any other gpuplace room: the
import-linter contracts in pyproject.toml keep it so.
"""
