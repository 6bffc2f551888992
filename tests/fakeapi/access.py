"""Re-export of `gpuplace.localapi.access`."""

from gpuplace.localapi.access import *  # noqa: F403
