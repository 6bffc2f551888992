"""The node agent's audit log: one JSON line per decision it takes about a pod.

The same conventions as the webhook's review lines (`gpuplace.webhook.auditing`): `time`
first (RFC 3339 UTC, milliseconds, `Z`), camelCase keys, `decision`, `reason` and a
`message` cut to `MAX_MESSAGE_CHARS`, never env values, tokens or object bodies; written by
`gpuplace.runtime.jsonlines` (a writer thread; a full queue drops and counts lines, never
stalls the agent). A line names the agent (`component`, `node`) and the pod (`uid`,
`namespace`, `name`), then what it is about.

Over-grant lines (`event: "overGrant"`, `gpuplace.agent.enforcing`) add the GPU (`gpu`
index, `uuid`), `kind` (`memory` or `clients`), `processes`, `usedBytes`, `grantedBytes`,
`allowedBytes` and `decision`: `reported` (caught, the operator chose no eviction),
`evicting` (caught, eviction asked), `evicted` (the Eviction API took it), `evictionRefused`
(the API refused: its PodDisruptionBudget, reason `TooManyRequests`; asked again at the
next sample), `evictionFailed` (any other API error) or `cleared` (no longer over).
"""

from __future__ import annotations

from typing import Any

from gpuplace.runtime.jsonlines import BATCH_SECONDS, LineWriter, Sink, cut, now

MAX_VALUE_CHARS = 253
"""Longest name kept whole (a DNS subdomain: pod names, namespaces)."""
MAX_MESSAGE_CHARS = 1000
COMPONENT = "node-agent"


class AgentAudit(LineWriter):
    """Formats the agent's decision lines for its writer thread (`LineWriter`)."""

    def __init__(self, sink: Sink, node: str, *, batch_seconds: float = BATCH_SECONDS) -> None:
        super().__init__(sink, batch_seconds=batch_seconds)
        self.node = node

    def write(
        self,
        *,
        event: str,
        decision: str,
        reason: str,
        uid: str,
        namespace: str,
        name: str,
        message: str = "",
        details: dict[str, Any] | None = None,
    ) -> None:
        """One line: who, then `details` (camelCase keys, plain values), then the verdict."""
        line: dict[str, Any] = {
            "time": now(),
            "component": COMPONENT,
            "node": cut(self.node, MAX_VALUE_CHARS),
            "event": event,
            "uid": uid,
            "namespace": cut(namespace, MAX_VALUE_CHARS),
            "name": cut(name, MAX_VALUE_CHARS),
        }
        line.update(details or {})
        line["decision"] = decision
        line["reason"] = reason
        if message:
            line["message"] = cut(message, MAX_MESSAGE_CHARS)
        self.put(line)
