"""What a developer or a first-time user runs without a cluster: the local Kubernetes API
(`localapi`, also the tests' API server) and the demo (`demo`, with its bundled nodes in
`data/`).

May import every room but the CLI; no room below it imports it.
"""
