"""The gateway's listening sockets, bound before anything else starts.

A port that another process holds is then one `cannot_start` line at once,
rather than uvicorn's errno after `serve`'s model has loaded for seconds. The
sockets are bound as asyncio's create_server binds a host (every address it
resolves to, IPv6 ones IPv6-only), and uvicorn listens on them once it starts.
"""

from __future__ import annotations

import errno
import socket

from gateway.settings import ServerSettings
from tokenrelay.lifecycle import CannotStart


def bound_sockets(server: ServerSettings) -> list[socket.socket]:
    """Sockets bound to every address of --host at --port, not listening yet."""
    where = f"{server.host}:{server.port}"
    try:
        addresses = socket.getaddrinfo(
            server.host or None, server.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        raise CannotStart(f"--host {server.host}: {error.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(addresses):
            sockets.append(socket.socket(family, kind, protocol))
            sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sockets[-1].setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sockets[-1].bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        if error.errno == errno.EADDRINUSE:
            raise CannotStart(f"{where} is in use: another process listens there (--host, --port)") from None
        raise CannotStart(f"cannot listen on {where}: {error.strerror} (--host, --port)") from None
    return sockets
