"""The gateway's HTTP server (uvicorn, the FastAPI app, its service on a bus) as its settings describe it."""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable

import structlog
import uvicorn

from bus.base import Bus
from gateway.app import create_app
from gateway.media.loader import MediaLoader
from gateway.service import GatewayService
from gateway.settings import GatewaySettings, ServerSettings, load_keys

log = structlog.get_logger("tokenrelay")


def http_server(
    server: ServerSettings,
    gateway: GatewaySettings,
    bus: Bus,
    more_metrics: Callable[[], Awaitable[bytes]] | None = None,
    sockets: list[socket.socket] | None = None,
) -> HttpServer:
    """The gateway's HTTP server, its service on `bus`; `more_metrics`: another process's /metrics text to add;
    `sockets`: bound to --host and --port already (tokenrelay/listening.py), else uvicorn binds them as it starts."""
    service = GatewayService(bus, gateway)
    app = create_app(
        service,
        MediaLoader(server.media),
        max_request_bytes=server.max_request_bytes,
        api_keys=load_keys(server.api_keys, server.api_keys_file),
        more_metrics=more_metrics,
    )
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_config=None,
        access_log=False,  # gateway/access_log.py writes ours, request ids and all
        ws_ping_interval=20.0,  # WebSocket clients are pinged; one silent for 20 s more is closed
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5.0,  # after the drain: only idle connections are left to close
        **_tls(server),
    )
    return HttpServer(config, service, sockets)


def _tls(server: ServerSettings) -> dict:
    """uvicorn's TLS settings: https with a certificate and key; client certificates required with a CA."""
    if not server.tls_cert:
        return {}
    tls = {"ssl_certfile": server.tls_cert, "ssl_keyfile": server.tls_key}
    if server.tls_ca:
        tls |= {"ssl_ca_certs": server.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: GatewayService, sockets: list[socket.socket] | None) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._sockets = sockets

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets or self._sockets)

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
