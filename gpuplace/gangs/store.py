"""The gang members the API has, grouped by gang: the gang-pod informer's handler.

`informer(api, store)` lists and watches pods labelled `gpuplace.io/managed=true` and
`gpuplace.io/gang` (the webhook puts both on every gang member) into the store, through
`gpuplace.cluster.watching.Informer` (resume from resourceVersion, relist on 410, backoff).
Each change calls the store's listeners (the controller's wake-up), synchronously.

Must not block and must not do I/O itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpuplace.cluster import keys, kube, watching
from gpuplace.gangs.members import GangPod, Reader
from gpuplace.placement.gangs import GangKey

SELECTOR = f"{keys.MANAGED}=true,{keys.GANG_LABEL}"


class GangStore:
    """Gang members by UID and by gang; see the module docstring."""

    def __init__(self) -> None:
        self.pods: dict[str, GangPod] = {}
        self._by_gang: dict[GangKey, dict[str, GangPod]] = {}
        self.synced = asyncio.Event()
        """Set once the first list is in."""
        self.listeners: list[Callable[[GangPod | None, GangPod | None], None]] = []

    # --- reading ---------------------------------------------------------------------

    def gangs(self) -> dict[GangKey, list[GangPod]]:
        """Every gang with its members (any state). O(gangs + members)."""
        return {key: list(members.values()) for key, members in self._by_gang.items()}

    def members(self, key: GangKey) -> list[GangPod]:
        return list(self._by_gang.get(key, {}).values())

    def get(self, uid: str) -> GangPod | None:
        return self.pods.get(uid)

    # --- the informer's handler ------------------------------------------------------

    def _index(self, pod: GangPod) -> None:
        if pod.gang:
            self._by_gang.setdefault(pod.key, {})[pod.uid] = pod

    def _unindex(self, pod: GangPod) -> None:
        members = self._by_gang.get(pod.key)
        if members is not None:
            members.pop(pod.uid, None)
            if not members:
                del self._by_gang[pod.key]

    def replace(self, objects: list[GangPod]) -> None:
        old = self.pods
        self.pods = {pod.uid: pod for pod in objects}
        self._by_gang = {}
        for pod in objects:
            self._index(pod)
        self.synced.set()
        for uid, pod in self.pods.items():
            self._tell(old.get(uid), pod)
        for uid, gone in old.items():
            if uid not in self.pods:
                self._tell(gone, None)

    def upsert(self, obj: GangPod) -> None:
        old = self.pods.get(obj.uid)
        if old is not None:
            self._unindex(old)
        self.pods[obj.uid] = obj
        self._index(obj)
        self._tell(old, obj)

    def delete(self, obj: GangPod) -> None:
        old = self.pods.pop(obj.uid, None)
        if old is not None:
            self._unindex(old)
        self._tell(old or obj, None)

    def _tell(self, old: GangPod | None, new: GangPod | None) -> None:
        for listener in self.listeners:
            listener(old, new)


def informer(
    api: kube.Kube,
    store: GangStore,
    *,
    page_size: int = 500,
    watch_seconds: int = 300,
    backoff: watching.Backoff | None = None,
    metrics: watching.InformerMetrics | None = None,
) -> watching.Informer[GangPod]:
    """The gang-pod informer feeding `store` (run it with `.run()`)."""
    return watching.Informer(
        api,
        "pods",
        store,
        Reader().record,
        label_selector=SELECTOR,
        page_size=page_size,
        watch_seconds=watch_seconds,
        backoff=backoff or watching.Backoff(),
        metrics=metrics,
    )
