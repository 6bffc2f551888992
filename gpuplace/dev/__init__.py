"""What a developer or a first-time user runs without a cluster: the local Kubernetes API
(`localapi`, also the tests' API server) and the demo (`demo`, with its bundled nodes in
`data/`).

Never loaded by `gpuplace serve`, `gpuplace node-agent` or `gpuplace certs` (an import
contract in `pyproject.toml` says so), and left out of the image (`.dockerignore`); the
demo's plot needs the `demo` extra (matplotlib). May import every room but the CLI; no
room below it imports it.
"""
