"""The demo's kube-apiserver, create path: admission over TLS, then storage.

What kube-apiserver does with `kubectl apply` of a pod when gpuplace's webhook
configurations are installed (deploy/base/webhooks.yaml): an AdmissionReview
`admission.k8s.io/v1` is POSTed to `/mutate?timeout=3s` over TLS, verified against the
configuration's caBundle for the Service name `gpuplace-webhook.gpuplace.svc`; the
returned JSONPatch is applied (`jsonpatch`); the patched pod goes to
`/validate?timeout=5s`; a denial at either step is the user's error message
(`admission webhook "validate.gpuplace.io" denied the request: …`); otherwise the pod
is stored, and the store gives it its uid, resourceVersion and creationTimestamp.

Never used against a real cluster: the store is `gpuplace.dev.localapi`'s, in memory.
"""

from __future__ import annotations

import base64
import json
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonpatch

from gpuplace.dev.demo.scenario import Submission
from gpuplace.dev.localapi import ApiStatusError, FakeApi

MUTATING = "mutate.gpuplace.io"
VALIDATING = "validate.gpuplace.io"
SERVICE_NAME = "gpuplace-webhook.gpuplace.svc"
"""The name kube-apiserver dials (and checks the serving certificate against)."""


@dataclass(slots=True)
class Admitted:
    """What `kubectl apply` would report: the stored pod, or the refusal."""

    submission: Submission
    pod: dict[str, Any] | None = None
    """The pod as stored (None when refused)."""
    refused_by: str = ""
    """The webhook (or "kube-apiserver") that refused it."""
    message: str = ""
    code: int = 0
    warnings: list[str] = field(default_factory=list)
    patch_ops: int = 0

    @property
    def refused(self) -> bool:
        return self.pod is None

    @property
    def error(self) -> str:
        """The message as kubectl prints it."""
        if self.refused_by == "kube-apiserver":
            return self.message
        return f'admission webhook "{self.refused_by}" denied the request: {self.message}'


class WebhookError(RuntimeError):
    """The webhook did not answer with an AdmissionReview (failurePolicy territory)."""


class ApiServer:
    """Admission + storage for pod creation; see the module docstring."""

    def __init__(
        self, api: FakeApi, session: aiohttp.ClientSession, webhook_url: str, ca_file: str
    ) -> None:
        self.api = api
        self.session = session
        self.webhook_url = webhook_url.rstrip("/")
        self.ssl = ssl.create_default_context(cafile=ca_file)

    async def _review(
        self, path: str, timeout: str, submission: Submission, obj: dict[str, Any]
    ) -> dict[str, Any]:
        uid = str(uuid.uuid4())
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": submission.name,
                "namespace": submission.namespace,
                "operation": "CREATE",
                "userInfo": {
                    "username": submission.user.username,
                    "groups": list(submission.user.groups),
                },
                "object": obj,
                "oldObject": None,
                "dryRun": False,
                "options": {
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "CreateOptions",
                    "fieldManager": "kubectl-client-side-apply",
                    "fieldValidation": "Strict",
                },
            },
        }
        url = f"{self.webhook_url}{path}?timeout={timeout}"
        async with self.session.post(
            url, json=review, ssl=self.ssl, server_hostname=SERVICE_NAME
        ) as response:
            if response.status != 200:
                raise WebhookError(
                    f"{path} answered HTTP {response.status}: {await response.text()}"
                )
            answer = await response.json()
        reply = answer.get("response") if isinstance(answer, dict) else None
        if not isinstance(reply, dict) or reply.get("uid") != uid:
            raise WebhookError(f"{path} answered without response.uid {uid}")
        return reply

    async def create(self, submission: Submission) -> Admitted:
        """Admit and store one pod (CREATE), as kube-apiserver would."""
        result = Admitted(submission)
        obj = json.loads(json.dumps(submission.pod))
        mutated = await self._review("/mutate", "3s", submission, obj)
        result.warnings += list(mutated.get("warnings") or [])
        if not mutated.get("allowed"):
            return _refused(result, MUTATING, mutated)
        if mutated.get("patch"):
            if mutated.get("patchType") != "JSONPatch":
                raise WebhookError(f"unexpected patchType {mutated.get('patchType')!r}")
            ops = json.loads(base64.b64decode(mutated["patch"]))
            result.patch_ops = len(ops)
            obj = jsonpatch.apply_patch(obj, ops)
        validated = await self._review("/validate", "5s", submission, obj)
        result.warnings += list(validated.get("warnings") or [])
        if not validated.get("allowed"):
            return _refused(result, VALIDATING, validated)
        try:
            result.pod = self.api.create(obj, submission.namespace)
        except ApiStatusError as error:
            result.refused_by, result.message, result.code = (
                "kube-apiserver",
                error.message,
                error.code,
            )
        return result


def _refused(result: Admitted, webhook: str, reply: dict[str, Any]) -> Admitted:
    status = reply.get("status") or {}
    result.refused_by = webhook
    result.message = str(status.get("message") or status.get("reason") or "denied")
    result.code = int(status.get("code") or 403)
    return result
