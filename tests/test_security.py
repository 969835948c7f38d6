"""API keys, https and mutual TLS on `tokenrelay serve`, with certificates from a throwaway CA (trustme)."""

from __future__ import annotations

import json
import ssl

import httpx
import openai
import pytest
import trustme
import websockets
from websockets.exceptions import InvalidStatus

from tests.processes import serving_https

MODEL = "tokenrelay-tiny"
BODY = {"text_input": "The following example", "parameters": {"max_new_tokens": 3}}


class _Tls:
    """A throwaway CA, a server certificate for 127.0.0.1, and client contexts with and without a certificate."""

    def __init__(self, directory) -> None:
        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        self.cert, self.key, self.ca = directory / "server.pem", directory / "server.key", directory / "ca.pem"
        server.cert_chain_pems[0].write_to_path(self.cert)
        server.private_key_pem.write_to_path(self.key)
        ca.cert_pem.write_to_path(self.ca)
        self.trusting = ssl.create_default_context(cafile=str(self.ca))
        self.with_client_cert = ssl.create_default_context(cafile=str(self.ca))
        ca.issue_cert("client@example").configure_cert(self.with_client_cert)

    def args(self, mutual: bool) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), *(["--tls-ca", str(self.ca)] * mutual)]


async def test_https_with_api_keys_refuses_requests_and_websockets_without_a_key(tmp_path):
    tls = _Tls(tmp_path)
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one key per line\nkey-from-file\n")
    keys = ["--api-keys", "key-from-flag", "--api-keys-file", str(keys_file)]
    with serving_https(tmp_path, [*tls.args(mutual=False), *keys], tls.trusting, {}) as served:
        base = served.base_url
        generate = f"{base}/v2/models/{MODEL}/generate"
        missing = httpx.post(generate, json=BODY, verify=tls.trusting, timeout=30)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error_type"] == "Unauthorized"
        wrong = httpx.post(generate, json=BODY, headers={"Authorization": "Bearer nope"}, verify=tls.trusting)
        assert wrong.status_code == 401
        for key in ("key-from-flag", "key-from-file"):
            ok = httpx.post(generate, json=BODY, headers={"Authorization": f"Bearer {key}"}, verify=tls.trusting)
            assert ok.status_code == 200 and ok.json()["text_output"], ok.text
        assert httpx.get(f"{base}/health", verify=tls.trusting).status_code == 200  # probes stay open

        with httpx.Client(verify=tls.trusting) as http_client:

            def client(key: str) -> openai.OpenAI:
                return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=http_client)

            with pytest.raises(openai.AuthenticationError):
                client("nope").models.list()
            assert [m.id for m in client("key-from-file").models.list()] == [MODEL]

        url = base.replace("https://", "wss://") + "/ws"
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(InvalidStatus):
                async with websockets.connect(url, ssl=tls.trusting, additional_headers=headers):
                    pass
        keyed_ws = {"Authorization": "Bearer key-from-flag"}
        async with websockets.connect(url, ssl=tls.trusting, additional_headers=keyed_ws) as socket:
            await socket.send(json.dumps({"op": "generate_stream", "model": MODEL, "id": "s", **BODY}))
            messages = [json.loads(await socket.recv()) for _ in range(4)]  # three tokens, then done
        assert messages[-1] == {"id": "s", "done": True} and all("data" in m for m in messages[:3])
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{base}/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # plain http on the https port
            httpx.get(base.replace("https://", "http://") + "/health", timeout=5)


def test_mutual_tls_serves_clients_with_a_certificate_of_its_ca_and_no_others(tmp_path):
    tls = _Tls(tmp_path)
    with serving_https(tmp_path, tls.args(mutual=True), tls.with_client_cert, {}) as served:
        base = served.base_url
        answer = httpx.post(f"{base}/v2/models/{MODEL}/generate", json=BODY, verify=tls.with_client_cert, timeout=60)
        assert answer.status_code == 200 and answer.json()["text_output"]
        with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
            httpx.get(f"{base}/health", verify=tls.trusting, timeout=5)  # no client certificate
