"""Re-export of `gpuplace.localapi.statuses` (the fake API server's code lives there)."""

from gpuplace.localapi.statuses import *  # noqa: F403
