"""Re-export of `gpuplace.localapi.store` (the fake API server's code lives there)."""

from gpuplace.localapi.store import *  # noqa: F403
