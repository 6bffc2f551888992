"""The fake API server's state: objects, resourceVersions, change history and watchers.

Everything kube-apiserver guarantees that gpuplace relies on, and nothing more:

- one cluster-wide resourceVersion counter (strings on the wire, increasing integers
  here), bumped by every write that changes an object; a write that changes nothing
  (a no-op patch) keeps the resourceVersion and sends no watch event, as the real
  server does;
- optimistic concurrency: a write carrying `metadata.resourceVersion` (or `uid`) that
  differs from the stored one fails with 409 Conflict;
- a bounded change history from which watches resume; a resourceVersion older than
  the history (after `compact`) is "too old" (410 Expired);
- label-selector watches that turn an object leaving the selection into DELETED and
  one entering it into ADDED (as the watch cache does);
- `status` subresources: writes to the object keep its status, writes to `/status`
  change only the status; `metadata.generation` where the resource keeps one (a custom
  resource with a status subresource: 1 at creation, one more whenever anything but
  metadata and status changes);
- namespaces carry the label `kubernetes.io/metadata.name` with their name (set on every
  write, as kube-apiserver's namespace strategy does);
- Secrets: `data` values must be base64 (400, as a body the server cannot decode), a
  `kubernetes.io/tls` Secret must hold `tls.crt` and `tls.key`, and `type` is immutable
  (422); a webhook configuration's `caBundle` must be base64 (400);
- pods: `spec.nodeName` is set only through the `binding` subresource (whose
  annotations are copied onto the pod, as kube-apiserver does); what an update may
  change of the spec is `podupdates` (gates only removed; while gated, node selector
  additions and node affinity narrowing only; 422 otherwise);
- the `eviction` subresource (`evict`), as pkg/registry/core/pod/storage/eviction.go:
  PodDisruptionBudget checked and decremented (429 TooManyRequests with a
  `DisruptionBudget` cause when it forbids), the pod recorded in the budget's
  `disruptedPods`, the UID precondition checked, the `DisruptionTarget` condition
  (reason `EvictionByEvictionAPI`) written, then a graceful deletion: a running pod on
  a node gets `deletionTimestamp` and stays until the kubelet (the test: `delete`)
  removes it; a pending or finished pod goes at once, after a MODIFIED event with its
  `deletionTimestamp` (grace 0), as kube-apiserver's registry does. A DELETE of a pod
  over HTTP is the same graceful deletion (`terminate`); `delete`, the test's
  synchronous helper, removes at once (the kubelet's last step).

All methods are synchronous and must run on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import itertools
import secrets
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpuplace.dev.localapi.patching import JSON_PATCH, MergeKeyMissing, PatchError, go_text
from gpuplace.dev.localapi.patching import apply as apply_patch
from gpuplace.dev.localapi.podupdates import check as check_pod_update
from gpuplace.dev.localapi.resources import (
    DEFAULT_RESOURCES,
    MUTATING_WEBHOOKS,
    NAMESPACES,
    PDBS,
    PODS,
    SECRETS,
    VALIDATING_WEBHOOKS,
    Resource,
)
from gpuplace.dev.localapi.selectors import Matcher, of_object, parse_fields
from gpuplace.dev.localapi.selectors import parse as parse_labels
from gpuplace.dev.localapi.statuses import (
    ApiStatusError,
    conflict,
    gone,
    invalid,
    not_found,
    success,
)

Obj = dict[str, Any]

ADDED = "ADDED"
MODIFIED = "MODIFIED"
DELETED = "DELETED"
BOOKMARK = "BOOKMARK"
ERROR = "ERROR"

DEFAULT_HISTORY = 100_000
MAX_DISRUPTED_PODS = 2000
"""kube-apiserver's `MaxDisruptedPodSize` (eviction.go): a budget whose
`status.disruptedPods` holds more entries refuses evictions (403)."""
"""Changes kept for watches to resume from (kube-apiserver's watch cache keeps fewer)."""


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Change:
    rv: int
    resource: Resource
    type: str
    obj: Obj
    """The object after the change (for DELETED: its last state)."""
    old: Obj | None
    """The object before (MODIFIED, DELETED), for selector transitions."""


@dataclass(slots=True, eq=False)
class Watcher:
    """One open watch: its filter and the queue the HTTP stream drains."""

    resource: Resource
    namespace: str | None
    labels: Matcher
    fields: Callable[[Mapping[str, object]], bool]
    bookmarks: bool = False
    """True when the client asked for BOOKMARK events (allowWatchBookmarks=true)."""
    queue: asyncio.Queue[tuple[str, Obj] | None] = field(default_factory=asyncio.Queue)
    abort: bool = False
    """Set when the stream must end as a broken connection rather than cleanly."""

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        metadata = obj.get("metadata") or {}
        if self.namespace is not None and metadata.get("namespace") != self.namespace:
            return False
        return self.labels(metadata.get("labels") or {}) and self.fields(obj)

    def event_for(self, change: Change) -> tuple[str, Obj] | None:
        """What this watcher sees of a change, after selector transitions."""
        now_in = change.type != DELETED and self.matches(change.obj)
        was_in = self.matches(change.old) if change.old is not None else False
        if change.type == DELETED:
            return (DELETED, change.obj) if self.matches(change.obj) else None
        if now_in and was_in:
            return (MODIFIED, change.obj)
        if now_in:
            return (ADDED, change.obj)
        if was_in:
            return (DELETED, change.obj)
        return None


def _key(obj: Obj) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))


def _without(obj: Obj, *keys: str) -> Obj:
    return {k: v for k, v in obj.items() if k not in keys}


class Store:
    """Objects by resource and (namespace, name); see the module docstring."""

    def __init__(
        self, resources: Iterable[Resource] = DEFAULT_RESOURCES, history: int = DEFAULT_HISTORY
    ) -> None:
        self._resources: dict[tuple[str, str], Resource] = {}
        self._objects: dict[Resource, dict[tuple[str, str], Obj]] = {}
        self._rv = 0
        self._history: deque[Change] = deque(maxlen=history)
        self._floor = 0
        self.watchers: set[Watcher] = set()
        self._continues: dict[str, tuple[Resource, int, list[Obj], bool]] = {}
        self._latest: dict[Resource, int] = {}
        """The resourceVersion of each resource's latest change (its bookmarks')."""
        for resource in resources:
            self.register(resource)

    # --- resources ----------------------------------------------------------------

    def register(self, resource: Resource) -> None:
        self._resources[(resource.group, resource.plural)] = resource
        self._objects.setdefault(resource, {})

    def resource(self, group: str, plural: str) -> Resource | None:
        return self._resources.get((group, plural))

    def resource_of(self, obj: Mapping[str, Any]) -> Resource:
        """The resource of an object from its `apiVersion` and `kind`."""
        api_version = str(obj.get("apiVersion") or "v1")
        kind = str(obj.get("kind") or "")
        for resource in self._resources.values():
            if resource.kind == kind and resource.api_version == api_version:
                return resource
        raise ApiStatusError(400, f"no kind {kind!r} is registered for {api_version}")

    @property
    def resource_version(self) -> int:
        return self._rv

    # --- reading ------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str | None, name: str) -> Obj:
        space = (namespace or "") if resource.namespaced else ""
        found = self._objects[resource].get((space, name))
        if found is None:
            raise not_found(resource.plural, name, resource.group)
        return found

    def items(self, resource: Resource) -> list[Obj]:
        return list(self._objects[resource].values())

    def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> tuple[list[Obj], str, str, int | None]:
        """(items, resourceVersion, continue token or "", remainingItemCount or None);
        pages share one snapshot. As kube-apiserver, a page of a list without selectors
        counts the items left after it; with a selector it cannot (None)."""
        if continue_token:
            saved = self._continues.pop(continue_token, None)
            if saved is None or saved[0] != resource:
                raise gone(
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter, or use "
                    "the continue token in this response to retrieve the remainder of the "
                    "results. Continuing with the provided token results in an inconsistent "
                    "list - objects that were created, modified, or deleted between the time "
                    "the first chunk was returned and now may show up in the list."
                )
            _, rv, remaining, counted = saved
        else:
            try:
                labels = parse_labels(label_selector)
                fields = parse_fields(field_selector)
            except ValueError as error:
                raise ApiStatusError(400, str(error)) from error
            watcher = Watcher(resource, namespace, labels, fields)
            counted = not label_selector and not field_selector
            rv = self._rv
            remaining = sorted(
                (obj for obj in self._objects[resource].values() if watcher.matches(obj)),
                key=_key,
            )
        if limit and limit > 0 and len(remaining) > limit:
            page, rest = remaining[:limit], remaining[limit:]
            token = secrets.token_urlsafe(12)
            self._continues[token] = (resource, rv, rest, counted)
            return page, str(rv), token, len(rest) if counted else None
        return remaining, str(rv), "", None

    def expire_continues(self) -> None:
        """Forget every continue token (the next page then answers 410)."""
        self._continues.clear()

    # --- writing ------------------------------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, resource: Resource, kind: str, obj: Obj, old: Obj | None) -> None:
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        change = Change(self._rv, resource, kind, obj, old)
        self._latest[resource] = self._rv
        self._history.append(change)
        for watcher in list(self.watchers):
            if watcher.resource is resource or watcher.resource == resource:
                event = watcher.event_for(change)
                if event is not None:
                    watcher.queue.put_nowait(event)

    def create(
        self, resource: Resource, obj: Obj, namespace: str | None = None, *, uid: str | None = None
    ) -> Obj:
        obj = copy.deepcopy(obj)
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise ApiStatusError(400, "metadata must be an object")
        if resource.namespaced:
            given = metadata.get("namespace")
            namespace = namespace or given or "default"
            if given and given != namespace:
                raise ApiStatusError(
                    400,
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            metadata["namespace"] = namespace
        else:
            metadata.pop("namespace", None)
        if not metadata.get("name"):
            prefix = metadata.get("generateName")
            if not prefix:
                raise invalid(
                    resource.kind, "", "metadata.name: Required value: name or generateName"
                )
            metadata["name"] = prefix + secrets.token_hex(3)[:5]
        name = str(metadata["name"])
        _check_kind(resource, obj, None)
        key = (str(metadata.get("namespace") or ""), name)
        if key in self._objects[resource]:
            raise ApiStatusError(
                409,
                f'{resource.plural} "{name}" already exists',
                reason="AlreadyExists",
                kind=resource.plural,
                name=name,
                group=resource.group,
            )
        obj["kind"] = resource.kind
        obj["apiVersion"] = resource.api_version
        metadata["uid"] = uid or str(uuid.uuid4())
        metadata["creationTimestamp"] = now()
        metadata.pop("deletionTimestamp", None)
        if resource.generation:
            metadata["generation"] = 1
        _name_label(resource, obj)
        if resource is PODS or resource == PODS:
            obj.setdefault("spec", {})
            status = obj.setdefault("status", {})
            status.setdefault("phase", "Pending")
            if obj["spec"].get("schedulingGates"):
                status.setdefault(
                    "conditions",
                    [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "SchedulingGated",
                            "message": "Scheduling is blocked due to non-empty scheduling gates",
                        }
                    ],
                )
        metadata["resourceVersion"] = str(self._next_rv())
        self._objects[resource][key] = obj
        self._record(resource, ADDED, obj, None)
        return obj

    def load(self, resource: Resource, objects: Iterable[Obj]) -> int:
        """Bulk set-up for big benchmarks: store `objects` as if they had existed before
        anyone watched (one resourceVersion each, no history, no copy: the store owns
        them and their sub-objects may be shared). Returns how many were stored."""
        count = 0
        for obj in objects:
            metadata = obj["metadata"]
            if resource.namespaced:
                metadata.setdefault("namespace", "default")
            metadata.setdefault("uid", str(uuid.uuid4()))
            metadata.setdefault("creationTimestamp", now())
            obj["kind"], obj["apiVersion"] = resource.kind, resource.api_version
            metadata["resourceVersion"] = str(self._next_rv())
            self._objects[resource][_key(obj)] = obj
            self._latest[resource] = self._rv
            count += 1
        self._history.clear()
        self._floor = self._rv
        return count

    def _preconditions(self, resource: Resource, old: Obj, new: Obj) -> None:
        name = old["metadata"]["name"]
        old_meta, new_meta = old["metadata"], new.get("metadata") or {}
        if new_meta.get("name") != name or new_meta.get("namespace") != old_meta.get("namespace"):
            raise invalid(resource.kind, name, "metadata.name: Invalid value: field is immutable")
        rv = new_meta.get("resourceVersion")
        if rv not in (None, "") and str(rv) != old_meta["resourceVersion"]:
            raise conflict(
                resource.plural,
                name,
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
                resource.group,
            )
        uid = new_meta.get("uid")
        if uid not in (None, "") and uid != old_meta["uid"]:
            raise conflict(
                resource.plural,
                name,
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {old_meta['uid']}",
                resource.group,
            )

    def update(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        new: Obj,
        subresource: str | None = None,
    ) -> Obj:
        """Replace an object (PUT, or the result of a PATCH), with every server rule."""
        old = self.get(resource, namespace, name)
        new = copy.deepcopy(new)
        self._preconditions(resource, old, new)
        new["kind"], new["apiVersion"] = resource.kind, resource.api_version
        metadata = new["metadata"]
        for immutable in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if immutable in old["metadata"]:
                metadata[immutable] = old["metadata"][immutable]
            else:
                metadata.pop(immutable, None)
        if subresource == "status":
            kept = copy.deepcopy(old)
            kept["status"] = new.get("status", {})
            new = kept
        elif subresource is not None:
            raise ApiStatusError(405, f"{subresource} does not support updates")
        elif "status" in resource.subresources:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        if resource == PODS and subresource is None:
            check_pod_update(old, new)
        _check_kind(resource, new, old)
        _name_label(resource, new)
        if resource.generation:
            generation = old["metadata"].get("generation", 1)
            spec_changed = _without(new, "metadata", "status") != _without(
                old, "metadata", "status"
            )
            new["metadata"]["generation"] = generation + 1 if spec_changed else generation
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return old
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        self._objects[resource][_key(old)] = new
        self._record(resource, MODIFIED, new, old)
        return new

    def patch(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        *,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Obj:
        old = self.get(resource, namespace, name)
        try:
            new = apply_patch(content_type, old, patch, resource.merge_keys)
        except MergeKeyMissing as error:
            raise ApiStatusError(500, str(error), reason="") from error
        except PatchError as error:
            if content_type.startswith(JSON_PATCH):
                raise invalid(resource.kind, name, str(error)) from error
            raise ApiStatusError(400, str(error)) from error
        try:
            return self.update(resource, namespace, name, new, subresource)
        except Undecodable as error:
            raise error.of_patch(patch) from error

    def delete(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        preconditions: Mapping[str, Any] | None = None,
    ) -> Obj:
        old = self.get(resource, namespace, name)
        if preconditions:
            probe = {"metadata": {**old["metadata"], **{k: v for k, v in preconditions.items()}}}
            self._preconditions(resource, old, probe)
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        del self._objects[resource][_key(old)]
        self._record(resource, DELETED, gone, old)
        return gone

    def evict(self, namespace: str, name: str, eviction: Mapping[str, Any]) -> Obj:
        """POST pods/NAME/eviction (policy/v1 Eviction); returns the success Status or
        raises the failure kube-apiserver answers (see the module docstring)."""
        if (eviction.get("metadata") or {}).get("name") != name:
            raise ApiStatusError(400, "name in URL does not match name in Eviction object")
        options = eviction.get("deleteOptions") or {}
        preconditions = options.get("preconditions") or {}
        pod = self.get(PODS, namespace, name)
        phase = (pod.get("status") or {}).get("phase")
        if phase not in ("Succeeded", "Failed", "Pending") and not pod["metadata"].get(
            "deletionTimestamp"
        ):
            self._disrupt(namespace, pod)
        uid = preconditions.get("uid")
        if uid not in (None, "") and uid != pod["metadata"]["uid"]:
            raise conflict(
                "Pod",
                name,
                f"the UID in the precondition ({uid}) does not match the UID in record "
                f"({pod['metadata']['uid']}). The object might have been deleted and then "
                "recreated",
            )
        if preconditions:
            probe = {"metadata": {**pod["metadata"], **dict(preconditions)}}
            self._preconditions(PODS, pod, probe)
        pod = self._disruption_target(pod)
        self._terminate(pod, preconditions, options.get("gracePeriodSeconds"))
        return success(201)

    def terminate(self, namespace: str, name: str, options: Mapping[str, Any]) -> Obj:
        """DELETE pods/NAME with DeleteOptions `options` (`_terminate`); the pod as it
        was left (its last state when it went at once)."""
        pod = self.get(PODS, namespace, name)
        preconditions = options.get("preconditions") or {}
        return self._terminate(pod, preconditions, options.get("gracePeriodSeconds"))

    def _disruption_target(self, pod: Obj) -> Obj:
        """The condition kube-apiserver (PodDisruptionConditions, GA in 1.31) writes on a
        pod it evicts, before deleting it."""
        conditions = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") != "DisruptionTarget"
        ]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": now(),
            }
        )
        status = {**(pod.get("status") or {}), "conditions": conditions}
        metadata = pod["metadata"]
        return self.update(
            PODS, metadata["namespace"], metadata["name"], {**pod, "status": status}, "status"
        )

    def _disrupt(self, namespace: str, pod: Obj) -> None:
        """The PodDisruptionBudget part of an eviction: check and decrement."""
        labels = pod["metadata"].get("labels") or {}
        budgets = []
        for candidate in self.list(PDBS, namespace)[0]:
            matcher = of_object((candidate.get("spec") or {}).get("selector"))
            if matcher is not None and matcher(labels):
                budgets.append(candidate)
        if len(budgets) > 1:
            raise ApiStatusError(
                500,
                "This pod has more than one PodDisruptionBudget, which the eviction "
                "subresource does not support.",
                reason="",
            )
        if not budgets:
            return
        pdb = budgets[0]
        status = dict(pdb.get("status") or {})
        pdb_name = pdb["metadata"]["name"]
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        )
        healthy, desired = status.get("currentHealthy", 0), status.get("desiredHealthy", 0)
        if not ready and healthy >= desired and desired > 0:
            return  # an unready pod does not count towards healthy: nothing to decrement
        if status.get("observedGeneration", 0) < pdb["metadata"].get("generation", 1):
            raise _too_many(
                f"The disruption budget {pdb_name} is still being processed by the server.", 10
            )
        allowed = status.get("disruptionsAllowed", 0)
        if allowed < 0:
            raise ApiStatusError(
                403,
                f'poddisruptionbudget.policy "{pdb_name}" is forbidden: pdb disruptions '
                "allowed is negative",
            )
        disrupted = dict(status.get("disruptedPods") or {})
        if len(disrupted) > MAX_DISRUPTED_PODS:
            raise ApiStatusError(
                403,
                f'poddisruptionbudget.policy "{pdb_name}" is forbidden: DisruptedPods map too '
                "big - too many evictions not confirmed by PDB controller",
            )
        if allowed == 0:
            raise _too_many(
                f"The disruption budget {pdb_name} needs {desired} healthy pods and has "
                f"{healthy} currently",
                0,
            )
        disrupted[pod["metadata"]["name"]] = now()
        status.update(disruptionsAllowed=allowed - 1, disruptedPods=disrupted)
        self.update(PDBS, namespace, pdb_name, {**pdb, "status": status}, "status")

    def _terminate(self, pod: Obj, preconditions: Mapping[str, Any], grace: object = None) -> Obj:
        """Delete a pod as kube-apiserver's pod strategy and registry do: it always gets
        `deletionTimestamp` and `deletionGracePeriodSeconds` first (a MODIFIED event);
        a pod bound to a node and not finished then stays for its grace period (the
        kubelet removes it: the test, `delete`), others (grace 0: unbound, finished or
        asked so) go at once (DELETED). Returns the pod as left (its last state)."""
        metadata = pod["metadata"]
        if preconditions:
            probe = {"metadata": {**metadata, **dict(preconditions)}}
            self._preconditions(PODS, pod, probe)
        namespace, name = metadata["namespace"], metadata["name"]
        phase = (pod.get("status") or {}).get("phase")
        bound = (pod.get("spec") or {}).get("nodeName")
        seconds = grace if isinstance(grace, int) else None
        if not bound or phase in ("Succeeded", "Failed"):
            seconds = 0
        if seconds is None:
            given = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            seconds = given if isinstance(given, int) else 30
        earlier = metadata.get("deletionGracePeriodSeconds")
        if metadata.get("deletionTimestamp") and (earlier is None or seconds >= earlier):
            return pod  # already terminating, no sooner
        new = copy.deepcopy(pod)
        new["metadata"]["deletionTimestamp"] = now()
        new["metadata"]["deletionGracePeriodSeconds"] = seconds
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        self._objects[PODS][_key(pod)] = new
        self._record(PODS, MODIFIED, new, pod)
        if seconds == 0:
            return self.delete(PODS, namespace, name)
        return new

    def bind(self, namespace: str, name: str, binding: Mapping[str, Any]) -> None:
        """POST pods/NAME/binding: set spec.nodeName once, with the Binding's annotations."""
        pod = self.get(PODS, namespace, name)
        metadata = binding.get("metadata") or {}
        target = binding.get("target") or {}
        if metadata.get("name") not in (None, "", name):
            raise ApiStatusError(400, "name in the URL does not match the Binding name")
        node = target.get("name")
        if not node or target.get("kind", "Node") != "Node":
            raise invalid("Binding", name, "target: Required value: a Node")
        uid = metadata.get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            # etcd3's storage error, as kube-apiserver lets it through
            raise conflict(
                "pods",
                name,
                f"StorageError: invalid object, Code: 4, Key: /registry/pods/{namespace}/{name}, "
                "ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: UID in "
                f"precondition: {uid}, UID in object meta: {pod['metadata']['uid']}",
            )
        rv = metadata.get("resourceVersion")
        if rv and rv != pod["metadata"]["resourceVersion"]:
            raise conflict(
                "pods/binding", name, "the object has been modified; please apply your changes"
            )
        if pod["metadata"].get("deletionTimestamp"):
            raise conflict(
                "pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host"
            )
        assigned = (pod.get("spec") or {}).get("nodeName")
        if assigned:
            raise conflict(
                "pods/binding", name, f'pod {name} is already assigned to node "{assigned}"'
            )
        if (pod.get("spec") or {}).get("schedulingGates"):
            raise conflict("pods/binding", name, f"pod {name} has non-empty .spec.schedulingGates")
        new = copy.deepcopy(pod)
        new["spec"]["nodeName"] = node
        annotations = metadata.get("annotations") or {}
        if annotations:
            new["metadata"].setdefault("annotations", {}).update(annotations)
        conditions = [
            c
            for c in new.setdefault("status", {}).get("conditions", [])
            if c.get("type") != "PodScheduled"
        ]
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": now()})
        new["status"]["conditions"] = conditions
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        self._objects[PODS][_key(pod)] = new
        self._record(PODS, MODIFIED, new, pod)

    # --- watching -----------------------------------------------------------------

    def watch(
        self,
        resource: Resource,
        namespace: str | None,
        *,
        label_selector: str | None,
        field_selector: str | None,
        resource_version: str | None,
        bookmarks: bool = False,
    ) -> Watcher:
        """Register a watcher, primed with what it must see first; raises 410 when too old."""
        try:
            labels = parse_labels(label_selector)
            fields = parse_fields(field_selector)
        except ValueError as error:
            raise ApiStatusError(400, str(error)) from error
        watcher = Watcher(resource, namespace, labels, fields, bookmarks)
        if resource_version in (None, "", "0"):
            for obj in sorted(self._objects[resource].values(), key=_key):
                if watcher.matches(obj):
                    watcher.queue.put_nowait((ADDED, obj))
        else:
            try:
                since = int(str(resource_version))
            except ValueError as error:
                raise ApiStatusError(
                    400, f"invalid resource version {resource_version!r}"
                ) from error
            if since < self._floor:
                raise gone("The resourceVersion for the provided watch is too old.")
            for change in itertools.dropwhile(lambda c: c.rv <= since, self._history):
                if change.resource == resource:
                    event = watcher.event_for(change)
                    if event is not None:
                        watcher.queue.put_nowait(event)
        self.watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def bookmark(self) -> None:
        """Every open watch that allows bookmarks gets one now (`bookmark_object`)."""
        for watcher in list(self.watchers):
            if watcher.bookmarks:
                watcher.queue.put_nowait((BOOKMARK, self.bookmark_object(watcher.resource)))

    def latest(self, resource: Resource) -> int:
        """The resourceVersion of `resource`'s latest change (0: none yet)."""
        return self._latest.get(resource, 0)

    def bookmark_object(self, resource: Resource) -> Obj:
        """A BOOKMARK's object: as kube-apiserver's watch cache, the resourceVersion its
        kind has reached (a change of another kind does not move it)."""
        return {
            "kind": resource.kind,
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self.latest(resource))},
        }

    def compact(self) -> None:
        """Drop the change history: a watch from any earlier resourceVersion, and a list
        `continue` of a page served before, get 410 (etcd's compaction)."""
        self._history.clear()
        self._floor = self._rv
        self._continues.clear()

    def close_watches(self, *, abort: bool = False, expire: bool = False) -> int:
        """End every open watch: cleanly, as a broken connection, or with a 410 ERROR."""
        count = 0
        for watcher in list(self.watchers):
            if expire:
                error = gone(f"too old resource version: {self._floor} ({self._rv})")
                watcher.queue.put_nowait((ERROR, error.body()))
            watcher.abort = abort
            watcher.queue.put_nowait(None)
            self.watchers.discard(watcher)
            count += 1
        return count


def _too_many(cause: str, retry_after: int) -> ApiStatusError:
    """eviction.go's 429: the real message, a DisruptionBudget cause."""
    return ApiStatusError(
        429,
        "Cannot evict pod as it would violate the pod's disruption budget.",
        causes=[{"reason": "DisruptionBudget", "message": cause}],
        retry_after=retry_after,
    )


class Undecodable(ApiStatusError):
    """A bytes field that is not base64: what kube-apiserver answers for such a body
    (400); `at` is the first byte Go's decoder refuses."""

    def __init__(self, resource: Resource, field: str, value: object) -> None:
        super().__init__(
            400,
            f'{resource.kind} in version "{resource.version}" cannot be handled as a '
            f"{resource.kind}: {field}: illegal base64 data",
        )
        text = str(value)
        self.at = next((i for i, c in enumerate(text) if c not in _ALPHABET), len(text))

    def of_patch(self, patch: object) -> ApiStatusError:
        """kube-apiserver's answer when a PATCH made the field so: 422 on the patch."""
        why = (
            f'Invalid value: "{go_text(patch)}": error decoding from json: '
            f"illegal base64 data at input byte {self.at}"
        )
        return ApiStatusError(
            422,
            f' "" is invalid: patch: {why}',
            causes=[{"reason": "FieldValueInvalid", "message": why, "field": "patch"}],
        )


def _name_label(resource: Resource, obj: Obj) -> None:
    """kube-apiserver labels every namespace with its own name."""
    if resource == NAMESPACES:
        metadata = obj["metadata"]
        labels = metadata.get("labels")
        metadata["labels"] = {
            **(labels if isinstance(labels, dict) else {}),
            NAME_LABEL: metadata["name"],
        }


NAME_LABEL = "kubernetes.io/metadata.name"


_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _undecodable(resource: Resource, field: str, value: object) -> Undecodable:
    return Undecodable(resource, field, value)


def _base64(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _check_kind(resource: Resource, new: Obj, old: Obj | None) -> None:
    """The rules of Secrets and webhook configurations (`old`: None on create)."""
    name = str((new.get("metadata") or {}).get("name") or "")
    if resource == SECRETS:
        data = new.get("data") or {}
        for key, value in data.items():
            if not _base64(value):
                raise _undecodable(resource, f"data[{key}]", value)
        kind = new.get("type") or "Opaque"
        if old is not None and kind != (old.get("type") or "Opaque"):
            raise invalid(resource.kind, name, f'type: Invalid value: "{kind}": field is immutable')
        if kind == "kubernetes.io/tls":
            for key in ("tls.crt", "tls.key"):
                if key not in data:
                    raise invalid(resource.kind, name, f"data[{key}]: Required value")
    elif resource in (MUTATING_WEBHOOKS, VALIDATING_WEBHOOKS):
        for index, webhook in enumerate(new.get("webhooks") or []):
            bundle = (webhook.get("clientConfig") or {}).get("caBundle")
            if bundle is not None and not _base64(bundle):
                raise _undecodable(resource, f"webhooks[{index}].clientConfig.caBundle", bundle)
