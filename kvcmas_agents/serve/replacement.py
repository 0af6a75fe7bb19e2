"""Replacing dead engine replicas: a fresh actor per dead slot, bounded against crash loops.

``ReplicaSupervisor`` owns each replica slot's state (alive, replacing, dead) and starts a fresh actor
for a slot whose replica died, as an ``asyncio`` task: the new actor loads its model in its own process
while the gateway's event loop keeps serving the live replicas. Replacements are bounded: at most
``max_replacements`` starts (all slots together) within any ``window_s``, and a slot's repeated
replacements within the window wait ``backoff_s`` doubling up to ``backoff_max_s``. A slot refused by
the cap stays dead until the window has room again (the backend's health check asks again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import exceptions as rex

log = logging.getLogger(__name__)

# What a dead or unreachable actor raises.
REPLICA_DOWN = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.OwnerDiedError)


@dataclass
class ReplacementConfig:
    """enabled: replace dead replicas at all (False: a dead replica stays dead, capacity is lost).
    max_replacements / window_s: at most this many replacement starts, all replicas together, within any
        window_s seconds (a crash loop stops there, and is reported in stats).
    backoff_s / backoff_max_s: a slot's first replacement within the window starts at once, its next
        ones after backoff_s, 2 x backoff_s, ... up to backoff_max_s.
    health_check_s: ping the live replicas this often, so one that died while idle is replaced before
        traffic finds it (None: only failed calls and ``stats()`` find dead replicas).
    """

    enabled: bool = True
    max_replacements: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    health_check_s: float | None = 10.0


class ReplacementBudget:
    """The crash-loop bound: replacement starts within a sliding window, and each slot's back-off."""

    def __init__(self, config: ReplacementConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._starts: deque[tuple[float, int]] = deque()      # (when, slot), oldest first

    def in_window(self, slot: int | None = None) -> int:
        """Starts within the window (of ``slot``, or of all slots)."""
        self._trim()
        return sum(1 for _, s in self._starts if slot is None or s == slot)

    def delay(self, slot: int) -> float:
        """How long ``slot``'s next replacement waits: 0 for its first within the window, then doubling."""
        n = self.in_window(slot)
        return 0.0 if n == 0 else min(self.config.backoff_s * 2 ** (n - 1), self.config.backoff_max_s)

    def take(self, slot: int) -> bool:
        """Count one start for ``slot`` if the window allows it."""
        if self.in_window() >= self.config.max_replacements:
            return False
        self._starts.append((self._clock(), slot))
        return True

    def _trim(self) -> None:
        now = self._clock()
        while self._starts and now - self._starts[0][0] >= self.config.window_s:
            self._starts.popleft()


@dataclass
class Slot:
    """One replica slot as the supervisor sees it."""

    state: str = "alive"                 # alive | replacing | dead
    generation: int = 0                  # actors this slot has had, less one
    task: asyncio.Task | None = None     # the replacement under way
    pending: Any = None                  # the actor being started
    refused: bool = False                # the cap refused its replacement


@dataclass
class SupervisorCounts:
    replaced: int = 0             # fresh actors that came up
    failed_starts: int = 0        # fresh actors that did not
    refused: int = 0              # replacements the cap refused


class ReplicaSupervisor:
    """Starts fresh actors for dead slots. ``spawn(slot)`` creates an actor (non-blocking), and
    ``install(slot, actor, info)`` puts a ready one in service; both belong to the backend."""

    def __init__(self, replicas: int, config: ReplacementConfig, spawn: Callable[[int], Any],
                 install: Callable[[int, Any, dict], None], ready_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.budget = ReplacementBudget(config, clock)
        self.slots = [Slot() for _ in range(replicas)]
        self.counts = SupervisorCounts()
        self._spawn, self._install, self._ready_timeout_s = spawn, install, ready_timeout_s
        self._closed = False

    def replica_died(self, slot: int) -> None:
        """The slot's actor is gone: replace it (now, after its back-off, or not at all past the cap)."""
        s = self.slots[slot]
        if s.state == "alive":
            s.state = "dead"
        self.retry(slot)

    def retry(self, slot: int) -> None:
        """Start a replacement for a dead slot if none is under way and the cap allows one."""
        s = self.slots[slot]
        if s.state == "replacing" and s.task is not None and s.task.get_loop().is_closed():
            self._drop_pending(s)            # its event loop ended under it (e.g. asyncio.run returned)
            s.state, s.task = "dead", None
        if s.state != "dead" or self._closed or not self.config.enabled:
            return
        delay = self.budget.delay(slot)
        if not self.budget.take(slot):
            if not s.refused:
                self.counts.refused += 1
                log.error("engine replica %d is not replaced: %d replacements within %.0f s (the cap)",
                          slot, self.config.max_replacements, self.config.window_s)
            s.refused = True
            return
        s.state, s.refused = "replacing", False
        s.task = asyncio.get_running_loop().create_task(self._replace(slot, delay))

    def retry_dead(self) -> None:
        for slot in range(len(self.slots)):
            self.retry(slot)

    async def _replace(self, slot: int, delay: float) -> None:
        s = self.slots[slot]
        if delay > 0:
            log.warning("engine replica %d: replacing it in %.1f s (back-off)", slot, delay)
            await asyncio.sleep(delay)
        s.pending = actor = self._spawn(slot)
        try:
            info = await asyncio.wait_for(actor.info.remote(), self._ready_timeout_s)
        except (*REPLICA_DOWN, asyncio.TimeoutError, rex.RayTaskError) as exc:
            self._drop_pending(s)
            self.counts.failed_starts += 1
            log.error("engine replica %d: its replacement failed to start: %s", slot, exc)
            s.state, s.task = "dead", None
            self.retry(slot)          # again after its back-off, within the cap
            return
        except asyncio.CancelledError:
            self._drop_pending(s)
            raise
        s.pending, s.task = None, None
        s.state, s.generation = "alive", s.generation + 1
        self.counts.replaced += 1
        self._install(slot, actor, info)
        log.warning("engine replica %d replaced (generation %d, pid %s)", slot, s.generation, info.get("pid"))

    def _drop_pending(self, s: Slot) -> None:
        if s.pending is not None:
            kill_actor(s.pending)
            s.pending = None

    def close(self) -> None:
        """Stop replacements under way and kill the actors they were starting."""
        self._closed = True
        for s in self.slots:
            if s.task is not None and not s.task.done() and not s.task.get_loop().is_closed():
                s.task.cancel()
            self._drop_pending(s)

    def stats(self) -> dict[str, Any]:
        states = [s.state for s in self.slots]
        return {"replacing": states.count("replacing"), "replaced": self.counts.replaced,
                "failed_starts": self.counts.failed_starts, "refused": self.counts.refused,
                "enabled": self.config.enabled, "in_window": self.budget.in_window(),
                "max_replacements": self.config.max_replacements, "window_s": self.config.window_s}


def kill_actor(actor: Any) -> None:
    """Kill an actor for good; one already gone is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:          # already gone
        pass
