"""The Events the gang controller writes on gang members (`kubectl describe pod`): their
reasons, each said once per episode (`gpuplace.controllers.telling.Told`).

Reasons shared with another room (the preemption Events, which the extender's preempt
verb writes too and `gpuplace explain` reads) are in `gpuplace.cluster.recording`.
Writing is `gpuplace.controllers.telling.emit`'s (queued, never blocking).
"""

from __future__ import annotations

PLACED = "GangPlaced"
WAITING = "GangWaiting"
INCOMPLETE = "GangIncomplete"
UNSCHEDULABLE = "GangUnschedulable"
TIMEOUT = "GangTimeout"
FULL = "GangFull"
ROLLED_BACK = "GangPlanRolledBack"
HELD = "GangCapacityHeld"
INVALID = "GangMemberInvalid"
BLOCKED = "GangControllerBlocked"
GROWING = "GangGrowing"
"""On the waiting members of an elastic gang that already runs."""
RESTARTING = "GangRestarting"
"""On each member a restart evicts (and its GangReady reason), and on the new members
waiting for the old run to finish."""
MEMBER_FAILED = "GangMemberFailed"
"""On the member whose failure restarts its gang (or, under `continue`, on the others)."""
RESTART_REFUSED = "GangRestartRefused"
"""On a member whose eviction for a restart was refused (tried again)."""
