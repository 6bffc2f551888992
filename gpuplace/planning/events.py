"""The Events the planner writes (`kubectl describe pod`): few, since a pod is behind its gate
for a moment only; each is said once per episode (`gpuplace.controllers.telling.Told`)."""

from __future__ import annotations

BLOCKED = "PlanControllerBlocked"
"""Warning: this replica cannot tell whether it leads (the Lease read is refused), so the
pod stays behind the gate `gpuplace.io/place`."""
