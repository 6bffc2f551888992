"""Each queue's share in the past, decayed: what makes fair sharing fair over time.

A queue's *past share* is the average of its weighted dominant share (`quotas.Accounts.
share`) over the time before now, each moment weighted by `0.5 ** (age / half_life)`
(an exponential moving average with that half-life). Fair sharing compares a borrowing
queue's share plus its past share (`quotas.Accounts.fair_share`), so a queue that was
held below the others for long may go past their share for a while, and one that
borrowed much waits behind them, until the averages meet: KAI scheduler's time-aware
fairness, and Kueue's admission fair sharing, which decay usage with a half-life too.

The share is taken to stay as last observed until the next observation (the controller
observes after every admission round; a share changes only through rounds, departures
and preemptions, each followed by one).

Pure: no I/O, no clock; times are the caller's seconds.
"""

from __future__ import annotations

from collections.abc import Mapping


class ShareHistory:
    """Per queue, its decayed past share. `observe` and `past` are O(queues)."""

    __slots__ = ("_held", "_since", "_values", "half_life")

    def __init__(self, half_life: float) -> None:
        if not half_life > 0:
            raise ValueError(f"the half-life must be > 0 seconds, got {half_life}")
        self.half_life = half_life
        self._values: dict[str, float] = {}
        self._held: dict[str, float] = {}
        self._since: float | None = None

    def past(self, now: float) -> dict[str, float]:
        """Each queue's past share at `now` (0 for one never seen), the share last
        observed counted up to `now`."""
        if self._since is None:
            return {}
        keep = 0.5 ** (max(0.0, now - self._since) / self.half_life)
        names = self._values.keys() | self._held.keys()
        return {
            name: self._values.get(name, 0.0) * keep + self._held.get(name, 0.0) * (1.0 - keep)
            for name in names
        }

    def restore(self, now: float, known: Mapping[str, tuple[float, float, float]]) -> None:
        """Start from what was remembered: per queue (its past share, its share then,
        when), each counted up to `now` as if that share had been held since (what a
        restarted controller reads back from the GpuQueues' statuses)."""
        values: dict[str, float] = {}
        held: dict[str, float] = {}
        for name, (past, share, when) in known.items():
            keep = 0.5 ** (max(0.0, now - when) / self.half_life)
            values[name] = past * keep + share * (1.0 - keep)
            if share > 0:
                held[name] = share
        self._values, self._held, self._since = values, held, now

    def observe(self, now: float, shares: Mapping[str, float]) -> None:
        """The queues' shares from `now` on (a queue not named: 0). A time before the
        last observation counts as the same moment."""
        if self._since is not None:
            self._values = self.past(now)
            now = max(now, self._since)
        self._held = {name: share for name, share in shares.items() if share > 0}
        self._since = now
