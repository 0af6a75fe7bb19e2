"""``RayBackend``: N engine replicas as Ray actors behind one gateway, with workflow affinity.

Plain Ray actors, not Ray Serve (docs/scale_out.md says why): the gateway process owns the router
(serve/router.py), so every request of a session reaches the replica holding that session's KV, and
new sessions go where the load is least. Deltas stream back through Ray streaming generators; closing
a stream cancels the actor task, which aborts the engine request and frees its KV.

A dead replica is replaced, not restarted by Ray (``max_restarts=0``): its sessions move at once to
the live replicas (their KV died with it, so nothing is gained by waiting for it), and a fresh actor
started in the background (serve/replacement.py) brings the replica count back to N, within a cap on
replacements per time window. A request whose replica dies before its first delta is retried once
on a live replica; one that had streamed fails with ReplicaUnavailableError.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import sysconfig
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import ray
from ray import exceptions as rex

from ..engine import EngineConfig, SamplingParams, StreamDelta
from ..errors import ReplicaUnavailableError
from .replacement import REPLICA_DOWN as _REPLICA_DOWN
from .replacement import ReplacementConfig, ReplicaSupervisor, kill_actor
from .replica import EngineReplica
from .router import AffinityRouter, RouterConfig

log = logging.getLogger(__name__)


@dataclass
class RayBackendConfig:
    """How the replicas are placed.

    replicas: engine replicas (Ray actors), each with its own KV cache.
    engine: every replica's EngineConfig. device "cuda"/"cuda:N" (or "auto" on a cluster with GPUs)
        gives each replica one whole GPU; else replicas run on CPU.
    address: the Ray cluster ("auto", "host:6379", "ray://host:10001"); None joins the Ray this process
        already started, else starts a local one sized to fit the replicas.
    cpus_per_replica: Ray CPUs each replica reserves (fractions allowed, to oversubscribe on purpose).
    threads_per_replica: the engine's intra-op threads (None: engine.num_threads, else
        max(1, floor(cpus_per_replica))), so replicas x threads matches the CPUs they reserve.
    runtime_env: the actors' Ray runtime_env (None: PYTHONPATH to this package when it runs from a
        source checkout, so the workers import the same copy).
    replacement: how dead replicas are replaced (ReplacementConfig: cap, back-off, health check).
    """

    replicas: int = 2
    engine: EngineConfig = field(default_factory=EngineConfig)
    address: str | None = None
    cpus_per_replica: float = 1.0
    threads_per_replica: int | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    runtime_env: dict[str, Any] | None = None
    ready_timeout_s: float = 600.0
    stats_timeout_s: float = 30.0
    replacement: ReplacementConfig = field(default_factory=ReplacementConfig)


def _source_checkout_env() -> dict[str, Any]:
    """PYTHONPATH to this package's source tree unless it is installed (then workers import theirs)."""
    root = Path(__file__).resolve().parents[2]
    site = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    if root in site:
        return {}
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def _sum_numbers(dicts: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


class RayBackend:
    """The gateway's Backend over engine replicas on Ray (see serve/backend.py for the protocol)."""

    def __init__(self, config: RayBackendConfig | None = None):
        self.config = cfg = config or RayBackendConfig()
        if cfg.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {cfg.replicas}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            self._start_ray()
        self.use_gpus = self._wants_gpus()
        self.router = AffinityRouter(cfg.replicas, cfg.router)
        self.errors: dict[int, str] = {}       # why each dead replica was marked dead
        self._actors = [self._spawn(i) for i in range(cfg.replicas)]
        try:
            self.replica_info = ray.get([a.info.remote() for a in self._actors], timeout=cfg.ready_timeout_s)
        except (*_REPLICA_DOWN, rex.GetTimeoutError) as exc:     # e.g. a bad model, or no GPU free
            self._kill_all()
            raise ReplicaUnavailableError(f"engine replicas failed to start: {exc}") from exc
        self.model_name = self.replica_info[0]["model_name"]
        self.max_context = self.replica_info[0]["max_context"]
        self.supervisor = ReplicaSupervisor(cfg.replicas, cfg.replacement, self._spawn, self._install,
                                            cfg.ready_timeout_s)
        self._health: asyncio.Task | None = None
        self._closed = False

    # --- setup -----------------------------------------------------------------------------
    def _start_ray(self) -> None:
        cfg = self.config
        if cfg.address is not None:
            ray.init(address=cfg.address, log_to_driver=False)
            return
        want = math.ceil(cfg.replicas * cfg.cpus_per_replica)
        cores = os.cpu_count() or 1
        if want > cores and not self._engine_on_cuda():
            log.warning("%d CPU replicas reserve %d CPUs on a %d-core machine: oversubscribed",
                        cfg.replicas, want, cores)
        ray.init(num_cpus=max(cores, want), include_dashboard=False, log_to_driver=False)

    def _engine_on_cuda(self) -> bool:
        return self.config.engine.device.startswith("cuda")

    def _wants_gpus(self) -> bool:
        device = self.config.engine.device
        if device == "auto":
            return ray.cluster_resources().get("GPU", 0) >= 1
        return device.startswith("cuda")

    def _spawn(self, index: int) -> Any:
        cfg = self.config
        engine = cfg.engine
        threads = cfg.threads_per_replica or engine.num_threads or max(1, math.floor(cfg.cpus_per_replica))
        # Ray shows each GPU actor only its own GPU, as cuda:0.
        device = "cuda" if self.use_gpus else "cpu"
        replica_config = replace(engine, device=device, num_threads=threads)
        options: dict[str, Any] = {"num_cpus": cfg.cpus_per_replica, "max_restarts": 0,
                                   "runtime_env": cfg.runtime_env if cfg.runtime_env is not None
                                   else _source_checkout_env()}
        if self.use_gpus:
            options["num_gpus"] = 1
        return ray.remote(EngineReplica).options(**options).remote(replica_config, index)

    # --- Backend protocol --------------------------------------------------------------------
    def stream(self, messages: list[dict], *, agent: str, sampling: SamplingParams,
               tools: list[dict] | None = None, tool_choice: Any = None, session: str | None = None,
               request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Stream from the replica serving ``session``. A replica that dies before the first delta is
        marked dead (and replaced) and the request is retried once on a live one; once deltas have
        flowed, or when the retry's replica dies too, it fails with ReplicaUnavailableError."""
        return self._stream(messages, agent, sampling, tools, tool_choice, session, request_id)

    async def _stream(self, messages: list[dict], agent: str, sampling: SamplingParams,
                      tools: list[dict] | None, tool_choice: Any, session: str | None,
                      request_id: str | None) -> AsyncIterator[StreamDelta]:
        self._ensure_health_check()
        for attempt in range(2):            # one retry, and only while nothing was streamed
            replica = self._acquire(session)
            actor = self._actors[replica]
            gen = actor.stream.remote(messages, agent, sampling, tools, tool_choice, request_id)
            started = finished = False
            try:
                async for ref in gen:
                    delta = await ref
                    started, finished = True, delta.output is not None
                    yield delta
                return
            except _REPLICA_DOWN as exc:
                self._mark_dead(replica, exc, actor)
                if started or attempt == 1:
                    what = "while serving this request" if started else "on the retry of this request"
                    raise ReplicaUnavailableError(
                        f"engine replica {replica} failed {what}: {_first_line(exc)}") from exc
            except rex.RayTaskError as exc:      # the engine's own error (InvalidRequestError, ...)
                raise _unwrap(exc) from None
            finally:
                if not finished:
                    _cancel(gen)
                self.router.release(replica)

    async def set_edges(self, edges: Iterable[tuple[str, str]], session: str | None = None) -> None:
        """On the session's replica (assigning the session now); without a session, on every live one."""
        self._ensure_health_check()
        edges = list(edges)
        targets = self.router.live if session is None else [self._route(session)]
        await asyncio.gather(*(self._call(i, "set_edges", edges) for i in targets))

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        self._ensure_health_check()
        for attempt in range(2):
            replica = self._route(None)
            actor = self._actors[replica]
            try:
                return await actor.count_tokens.remote(messages, tools)
            except _REPLICA_DOWN as exc:
                self._mark_dead(replica, exc, actor)
                if attempt == 1:
                    raise ReplicaUnavailableError(f"engine replica {replica} is down: {_first_line(exc)}") from exc
            except rex.RayTaskError as exc:
                raise _unwrap(exc) from None
        raise AssertionError("unreachable")

    async def stats(self) -> dict[str, Any]:
        """``{"replicas": [{"replica", "alive", "state", "generation", "sessions", "in_flight",
        **engine stats}], "alive", "replacing", "replaced", "replacement", "sessions", "counters",
        "memory"}``: counters and memory are the live replicas' figures summed; ``replacement`` is
        the supervisor's (failed starts, refused by the cap, starts in the window, the cap)."""
        self._ensure_health_check()
        self.supervisor.retry_dead()          # slots the cap refused earlier, once the window has room
        # One snapshot of the slots and the supervisor before any await: a replacement that completes
        # while the replicas answer must not be counted as replaced while its slot still reads dead.
        heads, sup = [self._replica_head(i) for i in range(self.config.replicas)], self.supervisor.stats()
        per = await asyncio.gather(*(self._replica_stats(h) for h in heads))
        live = [s for s in per if s["alive"] and "counters" in s]
        return {"replicas": per, "alive": sum(s["alive"] for s in per), "replacing": sup["replacing"],
                "replaced": sup["replaced"], "replacement": sup, "sessions": len(self.router),
                "counters": _sum_numbers([s["counters"] for s in live]),
                "memory": _sum_numbers([s["memory"] for s in live])}

    async def check_health(self) -> list[int]:
        """Ping the live replicas; those found dead are marked so (and replaced). Returns them."""
        async def ping(replica: int) -> int | None:
            actor = self._actors[replica]
            try:
                await asyncio.wait_for(actor.info.remote(), self.config.stats_timeout_s)
            except _REPLICA_DOWN as exc:
                self._mark_dead(replica, exc, actor)
                return replica
            except asyncio.TimeoutError:      # busy (a long prefill holds its loop), not dead
                pass
            return None

        dead = [r for r in await asyncio.gather(*(ping(i) for i in self.router.live)) if r is not None]
        self.supervisor.retry_dead()          # slots the cap refused earlier, once the window has room
        return dead

    async def aclose(self) -> None:
        """Kill the replicas (and the local Ray this backend started)."""
        if self._closed:
            return
        self._closed = True
        if self._health is not None and not self._health.get_loop().is_closed():
            self._health.cancel()
        self.supervisor.close()
        self._kill_all()

    def _kill_all(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()

    # --- helpers -----------------------------------------------------------------------------
    def replica_of(self, session: str) -> int | None:
        return self.router.replica_of(session)

    def actor(self, replica: int) -> Any:
        """The replica's actor handle (tests, ops)."""
        return self._actors[replica]

    async def _call(self, replica: int, method: str, *args: Any) -> Any:
        actor = self._actors[replica]
        try:
            return await getattr(actor, method).remote(*args)
        except _REPLICA_DOWN as exc:
            self._mark_dead(replica, exc, actor)
            raise ReplicaUnavailableError(f"engine replica {replica} is down: {_first_line(exc)}") from exc
        except rex.RayTaskError as exc:
            raise _unwrap(exc) from None

    def _replica_head(self, replica: int) -> dict[str, Any]:
        slot = self.supervisor.slots[replica]
        return {"replica": replica, "alive": self.router.replicas[replica].alive, "state": slot.state,
                "generation": slot.generation,
                "sessions": self.router.replicas[replica].sessions,
                "in_flight": self.router.replicas[replica].in_flight}

    async def _replica_stats(self, head: dict[str, Any]) -> dict[str, Any]:
        replica = head["replica"]
        if head["alive"]:
            try:
                got = await asyncio.wait_for(self._call(replica, "stats"), self.config.stats_timeout_s)
                return {**head, **got}
            except ReplicaUnavailableError:
                head["alive"], head["state"] = False, self.supervisor.slots[replica].state
            except asyncio.TimeoutError:
                head["error"] = f"stats timed out after {self.config.stats_timeout_s} s"
                return head
        return {**head, "error": self.errors.get(replica, "")}

    def _mark_dead(self, replica: int, exc: BaseException, actor: Any = None) -> None:
        """``actor`` (the handle the failed call used) is dead: stop routing to its slot and replace it.
        An error from an actor the slot no longer holds (a late failure of a replaced one) is ignored."""
        if actor is not None and actor is not self._actors[replica]:
            return
        if self.router.replicas[replica].alive:
            log.warning("engine replica %d is down; its sessions move to live replicas: %s",
                        replica, _first_line(exc))
            self.errors[replica] = _first_line(exc)
        self.router.mark_dead(replica)
        self.supervisor.replica_died(replica)

    def _install(self, replica: int, actor: Any, info: dict) -> None:
        """A fresh actor is ready: it takes the slot, and new sessions reach it by load."""
        if self._closed:
            kill_actor(actor)
            return
        old, self._actors[replica] = self._actors[replica], actor
        kill_actor(old)                # already dead; frees whatever Ray still holds for it
        self.replica_info[replica] = info
        self.router.mark_alive(replica)

    def _route(self, session: str | None, acquire: bool = False) -> int:
        try:
            return self.router.acquire(session) if acquire else self.router.route(session)
        except ReplicaUnavailableError as exc:
            replacing = self.supervisor.stats()["replacing"]
            if replacing:
                raise ReplicaUnavailableError(f"{exc} ({replacing} being replaced: retry shortly)") from None
            raise

    def _acquire(self, session: str | None) -> int:
        return self._route(session, acquire=True)

    def _ensure_health_check(self) -> None:
        """The periodic health check runs in the event loop serving requests (started on first use)."""
        every = self.config.replacement.health_check_s
        if every is None or self._closed:
            return
        loop = asyncio.get_running_loop()
        if self._health is None or self._health.done() or self._health.get_loop() is not loop:
            self._health = loop.create_task(self._health_loop(every))

    async def _health_loop(self, every: float) -> None:
        while not self._closed:
            await asyncio.sleep(every)
            try:
                await self.check_health()
            except Exception:          # never let one bad round end the checks
                log.exception("replica health check failed")


def _unwrap(exc: rex.RayTaskError) -> BaseException:
    """The exception the replica raised, as its own class (Ray wraps it)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _cancel(gen: Any) -> None:
    try:
        ray.cancel(gen)
    except Exception:          # already finished, or its actor is gone: nothing left to stop
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
