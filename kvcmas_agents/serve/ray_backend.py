"""``RayBackend``: N engine replicas as Ray actors behind one gateway, with workflow affinity.

Plain Ray actors, not Ray Serve (docs/scale_out.md says why): the gateway process owns the router
(serve/router.py), so every request of a session reaches the replica holding that session's KV, and
new sessions go where the load is least. Deltas stream back through Ray streaming generators; closing
a stream cancels the actor task, which aborts the engine request and frees its KV.

Replicas are not restarted (``max_restarts=0``): a restarted engine has lost its KV cache, so the
session would gain nothing by returning to it, and the gateway already re-routes to live replicas.
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
from .replica import EngineReplica
from .router import AffinityRouter, RouterConfig

log = logging.getLogger(__name__)

# What a dead or unreachable replica raises (its own errors come as RayTaskError, unwrapped below).
_REPLICA_DOWN = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.OwnerDiedError)


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
        marked dead and the request goes to another; once deltas have flowed, it fails with
        ReplicaUnavailableError (the client has seen part of an answer)."""
        return self._stream(messages, agent, sampling, tools, tool_choice, session, request_id)

    async def _stream(self, messages: list[dict], agent: str, sampling: SamplingParams,
                      tools: list[dict] | None, tool_choice: Any, session: str | None,
                      request_id: str | None) -> AsyncIterator[StreamDelta]:
        while True:
            replica = self.router.acquire(session)     # raises ReplicaUnavailableError when none is live
            gen = self._actors[replica].stream.remote(messages, agent, sampling, tools, tool_choice, request_id)
            started = finished = False
            try:
                async for ref in gen:
                    delta = await ref
                    started, finished = True, delta.output is not None
                    yield delta
                return
            except _REPLICA_DOWN as exc:
                self._mark_dead(replica, exc)
                if started:
                    raise ReplicaUnavailableError(
                        f"engine replica {replica} failed while serving this request: {_first_line(exc)}") from exc
            except rex.RayTaskError as exc:      # the engine's own error (InvalidRequestError, ...)
                raise _unwrap(exc) from None
            finally:
                if not finished:
                    _cancel(gen)
                self.router.release(replica)

    async def set_edges(self, edges: Iterable[tuple[str, str]], session: str | None = None) -> None:
        """On the session's replica (assigning the session now); without a session, on every live one."""
        edges = list(edges)
        targets = self.router.live if session is None else [self.router.route(session)]
        await asyncio.gather(*(self._call(i, "set_edges", edges) for i in targets))

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        while True:
            replica = self.router.route(None)
            try:
                return await self._actors[replica].count_tokens.remote(messages, tools)
            except _REPLICA_DOWN as exc:
                self._mark_dead(replica, exc)
            except rex.RayTaskError as exc:
                raise _unwrap(exc) from None

    async def stats(self) -> dict[str, Any]:
        """``{"replicas": [{"replica", "alive", "sessions", "in_flight", **engine stats}], "alive",
        "sessions", "counters", "memory"}``: the last two are the live replicas' figures summed."""
        per = await asyncio.gather(*(self._replica_stats(i) for i in range(self.config.replicas)))
        live = [s for s in per if s["alive"]]
        return {"replicas": per, "alive": len(live), "sessions": len(self.router),
                "counters": _sum_numbers([s["counters"] for s in live]),
                "memory": _sum_numbers([s["memory"] for s in live])}

    async def aclose(self) -> None:
        """Kill the replicas (and the local Ray this backend started)."""
        if self._closed:
            return
        self._closed = True
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
        try:
            return await getattr(self._actors[replica], method).remote(*args)
        except _REPLICA_DOWN as exc:
            self._mark_dead(replica, exc)
            raise ReplicaUnavailableError(f"engine replica {replica} is down: {_first_line(exc)}") from exc
        except rex.RayTaskError as exc:
            raise _unwrap(exc) from None

    async def _replica_stats(self, replica: int) -> dict[str, Any]:
        head = {"replica": replica, "alive": self.router.replicas[replica].alive,
                "sessions": self.router.replicas[replica].sessions,
                "in_flight": self.router.replicas[replica].in_flight}
        if head["alive"]:
            try:
                got = await asyncio.wait_for(self._call(replica, "stats"), self.config.stats_timeout_s)
                return {**head, **got}
            except ReplicaUnavailableError:
                head["alive"] = False
            except asyncio.TimeoutError:
                head["error"] = f"stats timed out after {self.config.stats_timeout_s} s"
                return head
        return {**head, "error": self.errors.get(replica, "")}

    def _mark_dead(self, replica: int, exc: BaseException) -> None:
        if self.router.replicas[replica].alive:
            log.warning("engine replica %d is down; its sessions move to live replicas: %s",
                        replica, _first_line(exc))
            self.errors[replica] = _first_line(exc)
        self.router.mark_dead(replica)


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
