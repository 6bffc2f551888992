"""Re-export of `gpuplace.localapi.selectors` (the fake API server's code lives there)."""

from gpuplace.localapi.selectors import *  # noqa: F403
