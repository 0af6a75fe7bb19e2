"""``kvcmas serve``: options, the backend they build, and running uvicorn."""
from __future__ import annotations

import argparse
import os

from ..engine import Engine, EngineConfig
from ..registry import ADAPTER_REUSE
from .backend import Backend, LocalBackend
from .config import ServeConfig

MIB = 1024 ** 2


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--reuse", default=ADAPTER_REUSE,
                        help=f"default reuse mode of requests (default {ADAPTER_REUSE}, as the adapters)")
    parser.add_argument("--kv-budget-mib", type=int, default=2048, help="KV cache budget in MiB (default 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (default 32)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $KVCMAS_API_KEY, else no auth)")
    parser.add_argument("--max-body-mib", type=float, default=4.0, help="largest request body (default 4 MiB)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt accepted (default: the model's context window)")
    parser.add_argument("--default-max-tokens", type=int, default=512,
                        help="completion cap when a request names none (default 512)")
    parser.add_argument("--served-model-name", default=None, help="model id to report (default: the model's)")
    parser.add_argument("--model-alias", action="append", default=[], metavar="ID",
                        help="another model id requests may name (repeatable); other ids get 404")
    parser.add_argument("--graceful-shutdown-s", type=float, default=30.0,
                        help="how long shutdown waits for requests in flight (default 30)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="engine replicas on Ray behind this endpoint, with workflow affinity (default 1: "
                             "one engine in this process; docs/scale_out.md)")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to place the replicas on ('auto', host:6379, ray://host:10001); "
                             "default with --replicas > 1: start a local Ray")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0,
                        help="Ray CPUs (and engine threads) each CPU replica takes (default 1)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The app's settings from the options (the API key falls back to $KVCMAS_API_KEY)."""
    return ServeConfig(host=args.host, port=args.port,
                       api_key=args.api_key or os.environ.get("KVCMAS_API_KEY") or None,
                       max_body_bytes=int(args.max_body_mib * MIB), max_prompt_tokens=args.max_prompt_tokens,
                       default_max_tokens=args.default_max_tokens, model_name=args.served_model_name,
                       model_aliases=tuple(args.model_alias),
                       graceful_shutdown_s=args.graceful_shutdown_s)


def build_backend(args: argparse.Namespace) -> Backend:
    """The backend the options ask for: one engine in this process, or, with ``--replicas`` > 1 or a
    ``--ray-address``, engine replicas on Ray (the ``ray`` extra)."""
    config = EngineConfig(model=args.model, device=args.device, reuse=args.reuse,
                          kv_budget_bytes=args.kv_budget_mib * MIB, max_num_seqs=args.max_num_seqs)
    replicas = getattr(args, "replicas", 1)
    address = getattr(args, "ray_address", None)
    if replicas < 1:
        raise SystemExit(f"kvcmas serve: --replicas must be >= 1, got {replicas}")
    if replicas == 1 and address is None:
        return LocalBackend(Engine(config))
    try:
        from .ray_backend import RayBackend, RayBackendConfig
    except ImportError as exc:
        raise SystemExit(f"kvcmas serve: --replicas/--ray-address need Ray: pip install 'kvcmas-agents[ray]' "
                         f"({exc})") from exc
    return RayBackend(RayBackendConfig(replicas=replicas, engine=config, address=address,
                                       cpus_per_replica=getattr(args, "cpus_per_replica", 1.0)))


def run(args: argparse.Namespace) -> int:
    """Build the backend, then serve until SIGINT/SIGTERM; shutdown drains requests, then closes it."""
    import uvicorn

    from .app import create_app

    config = serve_config(args)
    backend = build_backend(args)
    app = create_app(backend, config)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvcmas serve: warning: listening on {config.host} without an API key")
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                timeout_graceful_shutdown=config.graceful_shutdown_s)
    return 0
