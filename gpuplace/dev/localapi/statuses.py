"""`Status` bodies exactly as kube-apiserver sends them for failures (metav1.Status)."""

from __future__ import annotations

from typing import Any

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class ApiStatusError(Exception):
    """Raised inside the fake to answer with a Status body and HTTP `code`."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        kind: str = "",
        name: str = "",
        group: str = "",
        causes: list[dict[str, str]] | None = None,
        retry_after: int = 0,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = REASONS.get(code, "Unknown") if reason is None else reason
        """"" leaves `reason` out (a plain error kube-apiserver wraps as a 500)."""
        self.kind = kind
        self.name = name
        self.group = group
        self.causes = causes or []
        """`details.causes` (metav1.StatusCause: reason, message)."""
        self.retry_after = retry_after
        """`details.retryAfterSeconds` (0: left out, as omitempty does)."""

    def body(self) -> dict[str, Any]:
        body = status(
            self.code,
            self.message,
            reason=self.reason,
            kind=self.kind,
            name=self.name,
            group=self.group,
        )
        if self.causes or self.retry_after:
            details = body.setdefault("details", {})
            if self.causes:
                details["causes"] = list(self.causes)
            if self.retry_after:
                details["retryAfterSeconds"] = self.retry_after
        return body


def status(
    code: int,
    message: str,
    *,
    reason: str | None = None,
    kind: str = "",
    name: str = "",
    group: str = "",
) -> dict[str, Any]:
    """A failure Status; `kind`/`name` fill `details` as the API server does; a `reason`
    of "" is left out."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": REASONS.get(code, "Unknown") if reason is None else reason,
        "code": code,
    }
    if not body["reason"]:
        del body["reason"]
    if kind or name:
        details: dict[str, Any] = {"kind": kind}
        if name:
            details["name"] = name
        if group:
            details["group"] = group
        body["details"] = details
    return body


def success(code: int = 200) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code}


def not_found(plural: str, name: str, group: str = "") -> ApiStatusError:
    shown = plural if not group else f"{plural}.{group}"
    return ApiStatusError(404, f'{shown} "{name}" not found', kind=plural, name=name, group=group)


def conflict(plural: str, name: str, why: str, group: str = "") -> ApiStatusError:
    shown = plural if not group else f"{plural}.{group}"
    return ApiStatusError(
        409,
        f'Operation cannot be fulfilled on {shown} "{name}": {why}',
        kind=plural,
        name=name,
        group=group,
    )


def gone(message: str) -> ApiStatusError:
    return ApiStatusError(410, message, reason="Expired")


def invalid(kind: str, name: str, why: str) -> ApiStatusError:
    return ApiStatusError(422, f'{kind} "{name}" is invalid: {why}', kind=kind, name=name)
