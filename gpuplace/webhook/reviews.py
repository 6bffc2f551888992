"""AdmissionReview `admission.k8s.io/v1`: the request model and the response we send back.

The request is parsed from the raw body with `model_validate_json`; the pod (`object`,
`oldObject`) stays the raw dict the API server sent, because the patch is computed against
it. Unknown fields are ignored (newer API servers add some). A body that is not an
AdmissionReview v1 raises `ReviewError`, which the HTTP layer turns into a 400.
The response is built as a plain dict: only what the API server reads.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
MAX_ERRORS_SHOWN = 5


class ReviewError(ValueError):
    """The request is not a usable AdmissionReview (→ HTTP 400, not a denial)."""

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = tuple(details)


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="ignore"
    )


class GroupVersionKind(_Wire):
    group: str = ""
    version: str = ""
    kind: str = ""


class GroupVersionResource(_Wire):
    group: str = ""
    version: str = ""
    resource: str = ""


class UserInfo(_Wire):
    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()


class AdmissionRequest(_Wire):
    uid: str = Field(min_length=1, max_length=256)
    kind: GroupVersionKind
    resource: GroupVersionResource = GroupVersionResource()
    sub_resource: str = ""
    name: str = ""
    namespace: str = ""
    operation: Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]
    user_info: UserInfo = UserInfo()
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = None
    dry_run: bool = False

    @property
    def is_pod(self) -> bool:
        return self.kind.group == "" and self.kind.kind == "Pod"


class AdmissionReview(_Wire):
    api_version: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


def parse(body: bytes) -> AdmissionReview:
    """The review in `body`; raises `ReviewError` saying what is wrong."""
    try:
        return AdmissionReview.model_validate_json(body)
    except ValidationError as error:
        details = []
        for item in error.errors(include_url=False, include_input=False)[:MAX_ERRORS_SHOWN]:
            where = ".".join(str(part) for part in item["loc"]) or "body"
            details.append(f"{where}: {item['msg']}")
        if any(item["type"] == "json_invalid" for item in error.errors(include_url=False)):
            raise ReviewError("the body is not JSON", details) from None
        raise ReviewError(
            f"the body is not an AdmissionReview {API_VERSION} with a request", details
        ) from None


def allowed(
    uid: str,
    *,
    patch: Sequence[Mapping[str, Any]] = (),
    warnings: Sequence[str] = (),
    audit: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        encoded = json.dumps(list(patch), separators=(",", ":"), ensure_ascii=False)
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(encoded.encode()).decode("ascii")
    return _review(response, warnings, audit)


def denied(
    uid: str,
    *,
    code: int,
    reason: str,
    message: str,
    warnings: Sequence[str] = (),
    audit: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    status = {
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return _review({"uid": uid, "allowed": False, "status": status}, warnings, audit)


def _review(
    response: dict[str, Any], warnings: Sequence[str], audit: Mapping[str, str] | None
) -> dict[str, Any]:
    if warnings:
        response["warnings"] = list(warnings)
    if audit:
        response["auditAnnotations"] = dict(audit)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}
