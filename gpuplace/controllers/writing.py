"""A controller's API reads and writes of its pods, each safe to repeat.

`Writer.fetch` reads a member as the API has it now (None when it is gone or was
replaced: another UID under the same name). `Writer.write` applies a change as a JSON
merge patch carrying the pod's UID and resourceVersion as preconditions, and on 409
Conflict reads the pod again and recomputes the change (`attempts` times at most), so a
write never undoes one it did not see. `Writer.each` runs one such step on every member
of a gang, at most `concurrency` at once. The gang controller writes its plans and
conditions with it, the queue controller its admissions (`gpuplace.controllers.plans`
holds the steps both take). Owns no state; every failure is a
`gpuplace.cluster.kube.ApiError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from gpuplace.cluster import kube
from gpuplace.controllers.api import Pod, PodApi

T = TypeVar("T")

Change = Callable[[dict[str, Any]], dict[str, Any] | None]
"""The merge patch to apply to the pod as it is now, or None when nothing is left to do."""


class Writer:
    """See the module docstring."""

    def __init__(self, api: PodApi, *, concurrency: int, attempts: int) -> None:
        self.api = api
        self.concurrency = concurrency
        """API writes in flight at once for one gang."""
        self.attempts = attempts
        """Attempts of one write that hits 409 Conflict (re-read in between)."""

    async def fetch(self, pod: Pod) -> dict[str, Any] | None:
        """The pod as the API has it now; None when it is gone or was replaced."""
        try:
            fresh = await self.api.get_pod(pod.namespace, pod.name)
        except kube.ApiError as error:
            if error.not_found:
                return None
            raise
        if (fresh.get("metadata") or {}).get("uid") != pod.uid:
            return None
        return fresh

    async def fetch_quietly(self, pod: Pod) -> dict[str, Any] | None:
        """`fetch`, None on any API failure too."""
        try:
            return await self.fetch(pod)
        except kube.ApiError:
            return None

    async def each(self, items: Sequence[T], work: Callable[[T], Awaitable[Any]]) -> list[Any]:
        """`work` on every item, at most `concurrency` at once; results (or the
        exceptions raised) in order."""
        limit = asyncio.Semaphore(self.concurrency)

        async def one(item: T) -> Any:
            async with limit:
                return await work(item)

        return list(await asyncio.gather(*(one(item) for item in items), return_exceptions=True))

    async def write(
        self,
        pod: Pod,
        body: dict[str, Any] | None,
        change: Change,
        *,
        status: bool = False,
    ) -> dict[str, Any] | None:
        """Apply `change(body)` (a merge patch, or None when nothing is left to do) with
        UID and resourceVersion preconditions, re-reading on 409; `status`: to
        pods/NAME/status. Returns the pod after it, or None when the pod is gone."""
        for _ in range(self.attempts):
            if body is None:
                body = await self.fetch(pod)
                if body is None:
                    return None
            patch = change(body)
            if patch is None:
                return body
            metadata = patch.setdefault("metadata", {})
            metadata["uid"] = pod.uid
            metadata["resourceVersion"] = (body.get("metadata") or {}).get("resourceVersion")
            try:
                if status:
                    return await self.api.patch_pod_status(pod.namespace, pod.name, patch)
                return await self.api.patch_pod(pod.namespace, pod.name, patch)
            except kube.ApiError as error:
                if error.not_found:
                    return None
                if not error.conflict:
                    raise
                body = None
        raise kube.ApiError(409, "Conflict", f"pod {pod} kept changing; will retry")


def raise_first(results: list[Any]) -> list[Any]:
    """Results of `Writer.each`; the first exception among them is raised (after all ran)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
