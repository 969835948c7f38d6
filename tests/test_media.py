"""Multimodal media: where they may come from, and proof that nothing else is reached.

Local HTTP listeners stand in for hosts; each counts the connections it
accepts, so "refused" means no connection reached it, not just an error.
127.0.0.2 plays a public media host: the tests tell the loader to treat that
one loopback address as public (and only that one); every other address
keeps the real rules.
"""

from __future__ import annotations

import base64
import http.server
import threading

import httpx
import pytest

from gateway.media.loader import MediaLoader, MediaRefused, is_forbidden_address, resolve_host
from gateway.settings import MB, MediaPolicy
from tests.processes import serving

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
MEDIA_HOST = "media.example"  # resolved to 127.0.0.2 by the tests' resolver


class Listener(http.server.ThreadingHTTPServer):
    """An HTTP server on loopback that counts connections and answers as told."""

    def __init__(self, address: str, answer) -> None:
        self.connections = 0
        self.hosts: list[str] = []
        self.answer = answer  # (handler) -> None: writes the response
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hosts.append(self.headers["Host"])
                outer.answer(self)

            def log_message(self, *args):
                pass

        super().__init__((address, 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def verify_request(self, request, client_address) -> bool:
        self.connections += 1
        return True

    @property
    def port(self) -> int:
        return self.server_address[1]


def _ok(body: bytes, length: bool = True):
    def answer(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        if length:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def _redirect(location: str):
    def answer(handler):
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


@pytest.fixture
def victim():
    """What an attacker wants reached: a service on 127.0.0.1."""
    server = Listener("127.0.0.1", _ok(b"secret"))
    yield server
    server.shutdown()


@pytest.fixture
def media_host():
    server = Listener("127.0.0.2", _ok(PNG))
    yield server
    server.shutdown()


def _loader(tmp_path, allowed: set[str], image_cap: int = 40 * MB) -> MediaLoader:
    async def resolve(host: str, port: int) -> list[str]:
        return {MEDIA_HOST: ["127.0.0.2"], "loopy.example": ["127.0.0.1"]}.get(host) or await resolve_host(host, port)

    def forbidden(address: str) -> bool:
        return address != "127.0.0.2" and is_forbidden_address(address)

    policy = MediaPolicy(
        media_dir=tmp_path,
        allowed_domains=frozenset(allowed),
        max_bytes={"image_url": image_cap, "audio_url": 40 * MB, "video_url": 512 * MB},
    )
    return MediaLoader(policy, resolve=resolve, forbidden=forbidden)


@pytest.mark.parametrize("address", ["127.0.0.1", "169.254.169.254", "10.0.0.1", "192.168.1.1", "0.0.0.0", "[::1]"])
async def test_urls_naming_non_public_addresses_are_refused_unconnected(tmp_path, victim, address):
    host = address.strip("[]")
    loader = _loader(tmp_path, {host})
    with pytest.raises(MediaRefused, match=f"host {host} resolves to a non-public address"):
        await loader.load("image_url", f"http://{address}:{victim.port}/a.png")
    assert victim.connections == 0


@pytest.mark.parametrize("host", ["loopy.example", "localhost"])
async def test_names_that_resolve_to_loopback_are_refused_unconnected(tmp_path, victim, host):
    with pytest.raises(MediaRefused, match="resolves to a non-public address"):
        await _loader(tmp_path, {host}).load("image_url", f"http://{host}:{victim.port}/a.png")
    assert victim.connections == 0


async def test_hosts_not_on_the_list_are_refused(tmp_path, media_host):
    with pytest.raises(MediaRefused, match="host media.example is not in ALLOWED_MEDIA_DOMAINS_ENV"):
        await _loader(tmp_path, set()).load("image_url", f"http://{MEDIA_HOST}:{media_host.port}/a.png")
    assert media_host.connections == 0


async def test_an_allowed_host_is_fetched_from_the_address_that_was_checked(tmp_path, media_host):
    data = await _loader(tmp_path, {MEDIA_HOST}).load("image_url", f"http://{MEDIA_HOST}:{media_host.port}/a.png")
    assert data == PNG
    assert media_host.hosts == [f"{MEDIA_HOST}:{media_host.port}"]  # the name travels in Host, not the address


async def test_an_allowed_host_that_redirects_to_loopback_is_refused(tmp_path, victim):
    redirector = Listener("127.0.0.2", _redirect(f"http://127.0.0.1:{victim.port}/secret"))
    try:
        loader = _loader(tmp_path, {MEDIA_HOST, "127.0.0.1"})
        with pytest.raises(MediaRefused, match="host 127.0.0.1 resolves to a non-public address"):
            await loader.load("image_url", f"http://{MEDIA_HOST}:{redirector.port}/a.png")
        assert redirector.connections == 1 and victim.connections == 0
    finally:
        redirector.shutdown()


async def test_a_redirect_off_the_list_is_refused(tmp_path, victim):
    redirector = Listener("127.0.0.2", _redirect(f"http://loopy.example:{victim.port}/"))
    try:
        with pytest.raises(MediaRefused, match="host loopy.example is not in ALLOWED_MEDIA_DOMAINS_ENV"):
            await _loader(tmp_path, {MEDIA_HOST}).load("image_url", f"http://{MEDIA_HOST}:{redirector.port}/")
        assert victim.connections == 0
    finally:
        redirector.shutdown()


async def test_endless_redirects_are_refused(tmp_path):
    looping = Listener("127.0.0.2", None)
    looping.answer = _redirect(f"http://{MEDIA_HOST}:{looping.port}/again")
    try:
        with pytest.raises(MediaRefused, match="redirects more than 5 times"):
            await _loader(tmp_path, {MEDIA_HOST}).load("image_url", f"http://{MEDIA_HOST}:{looping.port}/")
        assert looping.connections == 6
    finally:
        looping.shutdown()


@pytest.mark.parametrize("declared", [True, False])
async def test_oversize_downloads_are_refused(tmp_path, declared):
    big = Listener("127.0.0.2", _ok(b"\x00" * (2 * MB), length=declared))
    try:
        with pytest.raises(MediaRefused, match="larger than 1 MB"):
            await _loader(tmp_path, {MEDIA_HOST}, image_cap=MB).load("image_url", f"http://{MEDIA_HOST}:{big.port}/")
    finally:
        big.shutdown()


async def test_files_must_resolve_under_the_media_directory(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    (media / "big.png").write_bytes(b"\x00" * (MB + 1))
    loader = _loader(media, set(), image_cap=MB)
    assert await loader.load("image_url", str(media / "cat.png")) == PNG
    assert await loader.load("image_url", "cat.png") == PNG
    assert await loader.load("image_url", f"file://{media / 'cat.png'}") == PNG
    for escape in ("../secret.png", str(tmp_path / "secret.png"), "link.png", "/etc/passwd"):
        with pytest.raises(MediaRefused, match="is not under the media directory"):
            await loader.load("image_url", escape)
    with pytest.raises(MediaRefused, match="does not exist"):
        await loader.load("image_url", "missing.png")
    with pytest.raises(MediaRefused, match="larger than 1 MB"):
        await loader.load("image_url", "big.png")
    with pytest.raises(MediaRefused, match="cannot be read"):
        await loader.load("image_url", "a\x00b.png")


async def test_data_uris(tmp_path):
    loader = _loader(tmp_path, set(), image_cap=MB)
    encoded = base64.b64encode(PNG).decode()
    assert await loader.load("image_url", f"data:image/png;base64,{encoded}") == PNG
    with pytest.raises(MediaRefused, match="of type audio/wav is not image/"):
        await loader.load("image_url", f"data:audio/wav;base64,{encoded}")
    with pytest.raises(MediaRefused, match="not valid base64"):
        await loader.load("image_url", "data:image/png;base64,!!!")
    with pytest.raises(MediaRefused, match="must be data:<mime>;base64"):
        await loader.load("image_url", "data:image/png,raw")
    with pytest.raises(MediaRefused, match="more than 1 MB"):
        await loader.load("image_url", "data:image/png;base64," + "A" * (2 * MB))
    with pytest.raises(MediaRefused, match="scheme ftp: is not supported"):
        await loader.load("image_url", "ftp://example.com/a.png")


def test_the_server_refuses_forbidden_media_and_then_media_a_text_model_cannot_take(tmp_path, victim):
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(PNG)
    env = {"ALLOWED_MEDIA_DOMAINS_ENV": "127.0.0.1,localhost,169.254.169.254,10.0.0.1"}
    with serving(tmp_path, "--media-dir", str(media), env=env) as served:

        def infer(items: list[dict]) -> httpx.Response:
            return httpx.post(served.url("/infer"), json={"inputs": [{"type": "text", "text": "Look:"}, *items]})

        for url in (
            f"http://127.0.0.1:{victim.port}/a.png",
            f"http://localhost:{victim.port}/a.png",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.1/a.png",
        ):
            answer = infer([{"type": "image_url", "image_url": url}])
            assert answer.status_code == 422 and "resolves to a non-public address" in answer.json()["error"], url
        assert victim.connections == 0
        not_listed = infer([{"type": "image_url", "image_url": "http://example.com/a.png"}])
        assert "host example.com is not in ALLOWED_MEDIA_DOMAINS_ENV" in not_listed.json()["error"]

        for item in (
            {"type": "image_url", "image_url": "cat.png"},
            {"image_url": f"data:image/png;base64,{base64.b64encode(PNG).decode()}"},
        ):
            answer = infer([item])
            assert answer.status_code == 422
            assert answer.json()["error"] == "model tokenrelay-tiny does not accept image input"
        stream = httpx.post(
            served.url("/v2/models/tokenrelay-tiny/generate_stream"),
            json={"text_input": [{"type": "audio_url", "audio_url": "data:audio/wav;base64,UklGRg=="}]},
        )
        assert (
            stream.status_code == 422 and stream.json()["error"] == "model tokenrelay-tiny does not accept audio input"
        )
        assert infer([{"type": "text", "text": "x"}] * 20).status_code == 422  # 21 items
