"""The kinds of objects the fake API server knows, and where they live on the wire.

A `Resource` says how an object kind is addressed (`/api/v1/namespaces/{ns}/pods`),
what it is called in JSON (`kind`, `apiVersion`), whether it is namespaced and which
subresources it has. `DEFAULT_RESOURCES` are the kinds gpuplace uses; tests that
need another kind pass their own `Resource` to `FakeApi(resources=...)` or `register`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resource:
    group: str
    """API group; "" for the core group (served under /api/v1)."""
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset({"status"})
    """Subresources PATCH/PUT/GET may address ("status"); pods also have "binding" and
    "eviction" (both POST only)."""
    merge_keys: tuple[tuple[str, str], ...] = ()
    """(top-level list, key) pairs a strategic merge patch merges item by item on the key,
    as the Go type's `patchMergeKey` says (`webhooks` by `name`); other lists are replaced."""
    generation: bool = False
    """The server keeps `metadata.generation`: 1 at creation, one more with every change of
    anything but metadata and status (custom resources with a status subresource)."""

    @property
    def api_version(self) -> str:
        return self.version if not self.group else f"{self.group}/{self.version}"

    @property
    def prefix(self) -> str:
        """URL path prefix of the group version: /api/v1 or /apis/GROUP/VERSION."""
        return "/api/v1" if not self.group else f"/apis/{self.group}/{self.version}"

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """The URL path of the collection or of one object."""
        parts = [self.prefix]
        if self.namespaced and namespace is not None:
            parts += ["namespaces", namespace]
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
        return "/".join(parts)


PODS = Resource("", "v1", "pods", "Pod", True, frozenset({"status", "binding", "eviction"}))
NODES = Resource("", "v1", "nodes", "Node", False)
EVENTS = Resource("", "v1", "events", "Event", True, frozenset())
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", False)
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap", True, frozenset())
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True, frozenset())
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True)
SECRETS = Resource("", "v1", "secrets", "Secret", True, frozenset())
GPUQUEUES = Resource(
    "gpuplace.io",
    "v1alpha1",
    "gpuqueues",
    "GpuQueue",
    False,
    frozenset({"status"}),
    generation=True,
)
"""The GpuQueue custom resource (deploy/base/gpuqueue-crd.yaml) as if its CRD were installed:
served with its status subresource and generation, without the CRD's schema and CEL rules
(gpuplace checks a queue again when it reads one: `gpuplace.cluster.gpuqueues`)."""
DRA = "resource.k8s.io"
RESOURCE_SLICES = Resource(DRA, "v1", "resourceslices", "ResourceSlice", False, frozenset())
RESOURCE_CLAIMS = Resource(DRA, "v1", "resourceclaims", "ResourceClaim", True)
DEVICE_CLASSES = Resource(DRA, "v1", "deviceclasses", "DeviceClass", False, frozenset())
"""Dynamic Resource Allocation's objects, stored as sent (no schema, no allocator: a test
writes a claim's `status.allocation` itself, as kube-scheduler would)."""
ADMISSION = "admissionregistration.k8s.io"
MUTATING_WEBHOOKS = Resource(
    ADMISSION,
    "v1",
    "mutatingwebhookconfigurations",
    "MutatingWebhookConfiguration",
    False,
    frozenset(),
    (("webhooks", "name"),),
)
VALIDATING_WEBHOOKS = Resource(
    ADMISSION,
    "v1",
    "validatingwebhookconfigurations",
    "ValidatingWebhookConfiguration",
    False,
    frozenset(),
    (("webhooks", "name"),),
)

DEFAULT_RESOURCES = (
    PODS,
    NODES,
    EVENTS,
    NAMESPACES,
    CONFIGMAPS,
    LEASES,
    PDBS,
    SECRETS,
    MUTATING_WEBHOOKS,
    VALIDATING_WEBHOOKS,
    GPUQUEUES,
    RESOURCE_SLICES,
    RESOURCE_CLAIMS,
    DEVICE_CLASSES,
)
