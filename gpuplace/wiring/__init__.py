"""The process wiring: one frozen settings object per process (`settings` for `gpuplace
serve`, `agent_settings` for `gpuplace node-agent`), the features built from them and
composed into one process (`sidecar`, `serving`, `composing`). Sits above every room it
wires and below the commands; nothing but the commands (and the demo) imports it."""
