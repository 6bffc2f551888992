"""Re-export of `gpuplace.localapi.patching` (the fake API server's code lives there)."""

from gpuplace.localapi.patching import *  # noqa: F403
