"""Re-export of `gpuplace.localapi.objects` (the fake API server's code lives there)."""

from gpuplace.localapi.objects import *  # noqa: F403
