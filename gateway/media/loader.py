"""Load the media of multimodal input, and nothing an attacker points us at.

Sources, per the contract:
- `data:<mime>;base64,...` URIs, of the item's media type;
- local files that resolve (after following links) under the media directory;
- http(s) URLs whose host is in the allow-list (ALLOWED_MEDIA_DOMAINS_ENV).

For URLs every hop is checked before connecting: the host must be on the
list, and every address it resolves to must be public (no loopback, private,
link-local, unspecified, multicast or reserved address). The connection then
goes to the address that was checked, not to a second lookup's answer, so a
name cannot be re-pointed between the check and the connection. Redirects
are followed by hand, each hop checked the same way. Sizes are capped while
reading. Anything refused raises MediaRefused, which the routes answer 422.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from gateway.settings import MB, MediaPolicy

MAX_REDIRECTS = 5
_MIME_PREFIX = {"image_url": "image/", "video_url": "video/", "audio_url": "audio/"}


class MediaRefused(Exception):
    """A media item that may not, or cannot, be loaded; the message says which and why."""


def is_forbidden_address(address: str) -> bool:
    """True for any address that is not a public unicast one."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def resolve_host(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


Resolver = Callable[[str, int], Awaitable[list[str]]]


class MediaLoader:
    def __init__(
        self,
        policy: MediaPolicy,
        resolve: Resolver = resolve_host,
        forbidden: Callable[[str], bool] = is_forbidden_address,
    ) -> None:
        self._policy = policy
        self._resolve = resolve  # tests resolve names to their own listeners
        self._forbidden = forbidden

    async def load(self, kind: str, reference: str) -> bytes:
        """The bytes of one media item of `kind` (image_url, video_url or audio_url)."""
        limit = self._policy.max_bytes[kind]
        scheme = urlsplit(reference).scheme.lower()
        if scheme == "data":
            return self._from_data_uri(kind, reference, limit)
        if scheme in ("http", "https"):
            return await self._fetch(reference, limit)
        if scheme in ("", "file"):
            return await asyncio.to_thread(self._from_file, reference, limit)
        raise MediaRefused(
            f"{kind} {_short(reference)}: scheme {scheme}: is not supported (data:, a file, http, https)"
        )

    @staticmethod
    def _from_data_uri(kind: str, reference: str, limit: int) -> bytes:
        header, separator, payload = reference.partition(",")
        mime = header[len("data:") :].split(";", 1)[0].lower()
        if not separator or not header.endswith(";base64"):
            raise MediaRefused(f"{kind}: a data URI must be data:<mime>;base64,<payload>")
        if not mime.startswith(_MIME_PREFIX[kind]):
            raise MediaRefused(f"{kind}: a data URI of type {mime or 'none'} is not {_MIME_PREFIX[kind]}*")
        if len(payload) * 3 // 4 > limit:
            raise MediaRefused(f"{kind}: the data URI holds more than {limit // MB} MB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaRefused(f"{kind}: the data URI is not valid base64: {error}") from None

    def _from_file(self, reference: str, limit: int) -> bytes:
        path = unquote(urlsplit(reference).path) if reference.startswith("file:") else reference
        root = self._policy.media_dir.resolve()
        try:
            resolved = (root / path).resolve()  # an absolute path replaces root; links are followed
            if not resolved.is_relative_to(root):
                raise MediaRefused(f"file {_short(reference)} is not under the media directory {root}")
            if not resolved.is_file():
                raise MediaRefused(f"file {_short(reference)} does not exist under the media directory")
            if resolved.stat().st_size > limit:
                raise MediaRefused(f"file {_short(reference)} is larger than {limit // MB} MB")
            return resolved.read_bytes()
        except (OSError, ValueError) as error:  # unreadable, or not a path at all (a NUL byte, say)
            raise MediaRefused(f"file {_short(reference)} cannot be read: {error}") from None

    async def _checked_address(self, url: str) -> tuple[httpx.URL, str]:
        """The URL and the public address to connect to for it; refuses anything else."""
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise MediaRefused(f"{_short(url)} is not an http(s) URL")
        host = parsed.host.lower()
        if host not in self._policy.allowed_domains:
            raise MediaRefused(f"host {host} is not in ALLOWED_MEDIA_DOMAINS_ENV")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            addresses = await self._resolve(host, port)
        except OSError as error:
            raise MediaRefused(f"host {host} does not resolve: {error}") from None
        forbidden = [a for a in addresses if self._forbidden(a)]
        if not addresses or forbidden:
            raise MediaRefused(f"host {host} resolves to a non-public address {forbidden[0] if forbidden else ''}")
        return parsed, addresses[0]

    async def _fetch(self, url: str, limit: int) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, timeout=self._policy.fetch_timeout_s) as client:
            for _ in range(MAX_REDIRECTS + 1):
                parsed, address = await self._checked_address(url)
                request = client.build_request(
                    "GET",
                    parsed.copy_with(host=address),
                    headers={"Host": parsed.netloc.decode()},
                    extensions={"sni_hostname": parsed.host},  # TLS still verifies the name, not the address
                )
                try:
                    response = await client.send(request, stream=True)
                except httpx.HTTPError as error:
                    raise MediaRefused(f"{_short(url)} cannot be fetched: {error}") from None
                async with aclosing(response):
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise MediaRefused(f"{_short(url)} answered HTTP {response.status_code}")
                    return await _read_capped(response, url, limit)
        raise MediaRefused(f"{_short(url)} redirects more than {MAX_REDIRECTS} times")


async def _read_capped(response: httpx.Response, url: str, limit: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise MediaRefused(f"{_short(url)} is larger than {limit // MB} MB")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise MediaRefused(f"{_short(url)} is larger than {limit // MB} MB")
    return bytes(body)


def _short(reference: str) -> str:
    return reference if len(reference) <= 80 else reference[:77] + "..."
