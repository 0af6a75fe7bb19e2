"""Workflow affinity across engine replicas: which replica serves a request (pure Python, no Ray).

Every request of one session goes to the replica that served the session before, so its agents' KV
stays shared there. A new session goes to the live replica with the least load (requests in flight,
then sessions held); requests without a session spread by load. A replica marked dead loses its
sessions, which move on their next request. The session map is bounded: least recently used sessions
are forgotten past ``max_sessions``, and idle ones after ``idle_ttl_s``.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..errors import ReplicaUnavailableError


@dataclass
class RouterConfig:
    """max_sessions: sessions remembered at most; idle_ttl_s: forget a session unused this long (None: never)."""

    max_sessions: int = 100_000
    idle_ttl_s: float | None = 3600.0


@dataclass
class ReplicaLoad:
    """One replica as the router sees it."""

    replica: int
    alive: bool = True
    in_flight: int = 0
    sessions: int = 0


class AffinityRouter:
    """Maps sessions to replicas and counts the load of each replica."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.config = config or RouterConfig()
        self.replicas = [ReplicaLoad(i) for i in range(num_replicas)]
        self._sessions: OrderedDict[str, tuple[int, float]] = OrderedDict()   # LRU first
        self._clock = clock
        self._turn = itertools.count()      # rotates ties among sessionless requests

    # --- routing ---------------------------------------------------------------------------
    def route(self, session: str | None) -> int:
        """The replica for ``session`` (assigning a new session to the least loaded live replica)."""
        now = self._clock()
        self._expire(now)
        if session is None:
            return self._least_loaded(rotate=True)
        held = self._sessions.get(session)
        if held is not None and self.replicas[held[0]].alive:
            replica = held[0]
        else:
            if held is not None:         # its replica died: moved below
                self._forget(session)
            replica = self._least_loaded(rotate=False)
            self.replicas[replica].sessions += 1
        self._sessions[session] = (replica, now)
        self._sessions.move_to_end(session)
        self._evict()
        return replica

    def acquire(self, session: str | None) -> int:
        """``route`` and count one request in flight on the chosen replica (pair with ``release``)."""
        replica = self.route(session)
        self.replicas[replica].in_flight += 1
        return replica

    def release(self, replica: int) -> None:
        r = self.replicas[replica]
        r.in_flight = max(r.in_flight - 1, 0)

    def replica_of(self, session: str) -> int | None:
        """Where ``session`` is held now, without routing it."""
        held = self._sessions.get(session)
        return held[0] if held is not None else None

    # --- liveness --------------------------------------------------------------------------
    def mark_dead(self, replica: int) -> None:
        """Stop routing to ``replica``; its sessions move to live replicas on their next request."""
        self.replicas[replica].alive = False
        for session in [s for s, (r, _) in self._sessions.items() if r == replica]:
            self._forget(session)

    def mark_alive(self, replica: int) -> None:
        self.replicas[replica].alive = True

    @property
    def live(self) -> list[int]:
        return [r.replica for r in self.replicas if r.alive]

    def __len__(self) -> int:
        """Sessions remembered."""
        return len(self._sessions)

    # --- internals -------------------------------------------------------------------------
    def _least_loaded(self, rotate: bool) -> int:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise ReplicaUnavailableError("no engine replica is alive")
        if rotate:       # equal loads take turns, so sessionless traffic does not pile on replica 0
            k = next(self._turn) % len(live)
            live = live[k:] + live[:k]
        return min(live, key=lambda r: (r.in_flight, r.sessions)).replica

    def _forget(self, session: str) -> None:
        replica, _ = self._sessions.pop(session)
        r = self.replicas[replica]
        r.sessions = max(r.sessions - 1, 0)

    def _expire(self, now: float) -> None:
        ttl = self.config.idle_ttl_s
        if ttl is None:
            return
        while self._sessions:
            session, (_, last) = next(iter(self._sessions.items()))
            if now - last < ttl:
                break
            self._forget(session)

    def _evict(self) -> None:
        while len(self._sessions) > self.config.max_sessions:
            self._forget(next(iter(self._sessions)))
