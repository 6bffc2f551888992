"""Re-export of `gpuplace.localapi.server` (the fake API server's code lives there)."""

from gpuplace.localapi.server import *  # noqa: F403
