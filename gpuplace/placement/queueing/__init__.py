"""The queue engine, a sub-room of the placement engine and pure as the rest of it.

Owns quota in GPU units (`quotas`), admission rounds (`admitting`), preemption to get
back lent quota (`reclaiming`), elastic gangs' arithmetic (`elastic`), fair entitlements
(`fairness`) and each queue's decayed past share (`share_history`), capacity holds for a
starving workload (`holds`), and the event-driven replay in time, with queues or without
(`timeline`). It builds on the rest of `gpuplace.placement` (ledger, fit, gangs, fences,
victim choice), which never imports it. No I/O, no clock, no logging: the contracts in
pyproject.toml keep it so.
"""
