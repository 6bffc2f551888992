"""The process wiring: the settings of each process (`settings` for `gpuplace serve`,
`agent_settings` for `gpuplace node-agent`), one builder per feature (`webhook`,
`extender`, `loads`, `node_agents`, `gangs`, `queues`, and the leader gate both
controllers share, `leading`), the scheduler sidecar composed from them (`sidecar`) and
the whole `serve` process (`serving`: its sites and contexts; `composing`). Sits above
every room it wires and below the commands; nothing but the commands (and the demo)
imports it.
"""
