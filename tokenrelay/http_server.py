"""The gateway's HTTP server (uvicorn, the FastAPI app, its service on a bus) as its flags describe it."""

from __future__ import annotations

import argparse
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
import uvicorn

from bus.base import Bus
from gateway.api_keys import load_keys
from gateway.app import create_app
from gateway.media import MediaLoader, MediaPolicy
from gateway.service import GatewayService, GatewaySettings

log = structlog.get_logger("tokenrelay")


def http_server(
    args: argparse.Namespace, bus: Bus, more_metrics: Callable[[], Awaitable[bytes]] | None = None
) -> HttpServer:
    settings = GatewaySettings(
        topic_prefix=args.topic_prefix,
        gateway_id=args.gateway_id,
        default_model=args.default_model,
        full_text=args.full_text_enabled,
        max_in_flight=args.max_in_flight,
        route=not args.no_router,
    )
    media = MediaLoader(
        MediaPolicy(
            media_dir=Path(args.media_dir),
            allowed_domains=MediaPolicy.parse_domains(args.allowed_media_domains),
        )
    )
    service = GatewayService(bus, settings)
    app = create_app(
        service,
        media,
        max_request_bytes=args.max_request_length * 1024 * 1024,
        api_keys=load_keys(args.api_keys, args.api_keys_file),
        more_metrics=more_metrics,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,  # gateway/access_log.py writes ours, request ids and all
        ws_ping_interval=20.0,  # WebSocket clients are pinged; one silent for 20 s more is closed
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5.0,  # after the drain: only idle connections are left to close
        **_tls(args),
    )
    return HttpServer(config, service)


def _tls(args: argparse.Namespace) -> dict:
    """uvicorn's TLS settings: https with --tls-cert/--tls-key; client certificates required with --tls-ca."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise SystemExit("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
    if not args.tls_cert:
        return {}
    tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
    if args.tls_ca:
        tls |= {"ssl_ca_certs": args.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: GatewayService) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            scheme = "https" if self.config.is_ssl else "http"
            log.info("serving", url=f"{scheme}://{self.config.host}:{self.config.port}")

    @contextlib.contextmanager
    def capture_signals(self):
        # This process handles SIGINT/SIGTERM itself (see lifecycle.run), so that it can
        # stop the worker too; uvicorn would re-raise them after its own stop.
        yield
