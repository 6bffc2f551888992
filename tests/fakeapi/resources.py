"""Re-export of `gpuplace.localapi.resources` (the fake API server's code lives there)."""

from gpuplace.localapi.resources import *  # noqa: F403
