"""One module per `gpuplace` sub-command; each exposes `register(subparsers)`."""
