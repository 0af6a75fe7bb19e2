"""The engine's worker thread: built there, served there, stopped from any thread (module functions, so
the thread never keeps the engine alive)."""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import torch

from ..errors import ConfigError, InvalidRequestError
from .worker import CLOSE


def build_error(exc: BaseException) -> BaseException:
    """The engine's own error for a failed build: bad values (ValueError from the loader, e.g. an unknown
    dtype or a CUDA device on a CPU host) become ConfigError; ours and the rest pass as they are."""
    if isinstance(exc, ValueError) and not isinstance(exc, (ConfigError, InvalidRequestError)):
        err = ConfigError(str(exc))
        err.__cause__ = exc
        return err
    return exc


def serve(ref: "weakref.ref[Any]", threads: int, ready: threading.Event, built: dict[str, BaseException]) -> None:
    """The worker thread: builds the engine, then serves. All torch work stays on this one thread, so
    the engine does not leave an OpenMP team behind on the caller's thread (EngineConfig.num_threads)."""
    engine = ref()
    try:
        torch.set_num_threads(threads)
        engine._build()
        worker = engine.worker
    except BaseException as exc:        # re-raised by __init__ in the caller's thread
        built["error"] = build_error(exc)
        return
    finally:
        del engine
        ready.set()
    worker.loop()


def stop_worker(inbox: "queue.Queue[tuple[str, Any]]", thread: threading.Thread) -> None:
    """Close the worker and wait for it (close(), the engine's finalizer, or interpreter exit)."""
    inbox.put((CLOSE, None))
    if thread is not threading.current_thread():     # a finalizer run by the worker's own gc
        thread.join()
