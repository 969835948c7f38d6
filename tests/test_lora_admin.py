"""LoRA adapters loaded and unloaded at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter).

Who may load (--admin-api-keys), what (a directory under --lora-root, its
path resolved before anything is read) and which adapters (checked against
what the model's workers announce), on `serve`; on Kafka, that the fleet's
adapters are a compacted topic read from its beginning: a worker or a
gateway started after a load serves the adapter too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from bus.inprocess import InProcessBus
from gateway.errors import ApiError
from gateway.routes.lora import check_admin, under_root
from schemas.messages import AdapterState
from tests.processes import free_port, serving, wait_ready
from workers.bundled import BUNDLED_ADAPTERS

MODEL = "tokenrelay-tiny"
KEY = {"Authorization": "Bearer secret"}
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _adapter(directory: Path) -> Path:
    """A copy of the bundled `shout` adapter in `directory`."""
    shutil.copytree(BUNDLED_ADAPTERS["shout"], directory)
    return directory


# -- the path and key checks, alone


def test_a_path_must_resolve_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "shout").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    (root / "inner-link").symlink_to(root / "shout")
    real = os.path.realpath(root)
    assert under_root(str(root / "shout"), real) == str(root / "shout")
    assert under_root("shout", real) == str(root / "shout")  # relative: under the root
    assert under_root(str(root / "inner-link"), real) == str(root / "shout")
    assert under_root(str(root), real) == real
    for outside in (str(root / ".." / "outside"), "../outside", str(root / "link"), "/etc", str(root) + "-sibling"):
        assert under_root(outside, real) is None, outside


@pytest.mark.parametrize(
    ("keys", "authorization", "status", "says"),
    [
        ((), "Bearer secret", 403, "--admin-api-keys"),
        (("secret",), None, 401, "Authorization: Bearer"),
        (("secret",), "Basic secret", 401, "Authorization: Bearer"),
        (("secret",), "Bearer wrong", 403, "not one of --admin-api-keys"),
    ],
)
def test_only_an_admin_key_may_load(keys, authorization, status, says):
    service = SimpleNamespace(settings=SimpleNamespace(admin_api_keys=keys))
    with pytest.raises(ApiError) as refused:
        check_admin(service, authorization)
    assert refused.value.status == status and says in refused.value.body.error
    check_admin(SimpleNamespace(settings=SimpleNamespace(admin_api_keys=("other", "secret"))), "Bearer secret")


# -- on serve


def _complete(client: httpx.Client, base: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The meaning of life is", "max_tokens": 12, "temperature": 0}
    return client.post(f"{base}/v1/completions", json=body)


def test_adapters_load_and_unload_on_serve_for_admins_only(tmp_path):
    root = tmp_path / "loras"
    shout = _adapter(root / "shout")
    high = root / "too-high"
    shutil.copytree(shout, high)
    config = json.loads((high / "adapter_config.json").read_text())
    (high / "adapter_config.json").write_text(json.dumps({**config, "r": 128}))
    (root / "escape").symlink_to(BUNDLED_ADAPTERS["shout"].parent)
    args = ("--admin-api-keys", "secret", "--lora-root", str(root), "--max-loras", "2")
    with serving(tmp_path, *args) as served, httpx.Client(timeout=60) as client:
        base = served.base_url
        body = {"lora_name": "shout", "lora_path": str(shout)}
        assert client.post(base + LOAD, json=body).status_code == 401
        wrong = client.post(base + LOAD, json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403 and "--admin-api-keys" in wrong.json()["error"]["message"]
        for outside in (str(BUNDLED_ADAPTERS["shout"]), f"{root}/../x", str(root / "escape" / "shout")):
            refused = client.post(base + LOAD, json={**body, "lora_path": outside}, headers=KEY)
            assert refused.status_code == 403 and "--lora-root" in refused.json()["error"]["message"], refused.text
        too_high = client.post(base + LOAD, json={"lora_name": "high", "lora_path": str(high)}, headers=KEY)
        assert too_high.status_code == 400 and "r=128" in too_high.json()["error"]["message"], too_high.text
        taken = client.post(base + LOAD, json={**body, "lora_name": MODEL}, headers=KEY)
        assert taken.status_code == 400 and "already the name" in taken.text

        loaded = client.post(base + LOAD, json=body, headers=KEY)
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'shout' added successfully."
        cards = {card["id"]: card for card in client.get(base + "/v1/models").json()["data"]}
        assert cards["shout"]["parent"] == MODEL and cards["shout"]["root"] == str(shout)
        answer = _complete(client, base, "shout")
        assert answer.status_code == 200, answer.text
        # Generated under the adapter (what it generates, PEFT's tokens, is tests/test_lora.py's to check).
        assert answer.json()["choices"][0]["text"] != _complete(client, base, MODEL).json()["choices"][0]["text"]

        removed = client.post(base + UNLOAD, json={"lora_name": "shout"}, headers=KEY)
        assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'shout' removed successfully."
        gone = _complete(client, base, "shout")
        assert gone.status_code == 404 and MODEL in gone.json()["error"]["message"], gone.text
        unknown = client.post(base + UNLOAD, json={"lora_name": "shout"}, headers=KEY)
        assert unknown.status_code == 404, unknown.text
        assert [e["adapter"] for e in served.process.events_named("adapter_removed")] == ["shout"]


def test_serve_without_admin_keys_refuses_loads(compat_server):
    body = {"lora_name": "shout", "lora_path": str(BUNDLED_ADAPTERS["shout"])}
    refused = httpx.post(compat_server.url(LOAD), json=body, headers=KEY, timeout=30)
    assert refused.status_code == 403 and "--admin-api-keys" in refused.json()["error"]["message"], refused.text


# -- on Kafka


async def _logged(process, event: str) -> dict:
    """The process's first log line of `event`, once it has written one."""
    while not process.events_named(event):
        assert process.popen.poll() is None, process.log_tail()
        await asyncio.sleep(0.2)
    return process.events_named(event)[0]


@pytest.mark.kafka
async def test_a_worker_and_a_gateway_started_after_a_load_serve_the_adapter(
    tmp_path, kafka_bootstrap, topic_prefix, spawn
):
    root = tmp_path / "loras"
    shout = _adapter(root / "shout")
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    worker = ("worker", *kafka, "--max-loras", "2")
    admin = ("--admin-api-keys", "secret", "--lora-root", str(root))
    first = spawn(*worker, "--worker-id", "w0")
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka, *admin)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, MODEL, [first, gateway])
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"lora_name": "shout", "lora_path": "shout"}  # relative: under --lora-root
        loaded = await client.post(base + LOAD, json=body, headers=KEY)
        assert loaded.status_code == 200, loaded.text
        second = spawn(*worker, "--worker-id", "w1")  # after the load: it reads the compacted topic from the start
        body = {"model": "shout", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answers = await asyncio.gather(*(client.post(base + "/v1/completions", json=body) for _ in range(4)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert (await _logged(first, "adapter_added"))["adapter"] == "shout"
        assert (await _logged(second, "adapter_added"))["path"] == str(shout)

        late = free_port()  # a gateway that starts now knows the adapter from the topic
        wait_ready(f"http://127.0.0.1:{late}", MODEL, [spawn("gateway", "--port", str(late), *kafka)])
        models = (await client.get(f"http://127.0.0.1:{late}/v1/models")).json()["data"]
        assert "shout" in {card["id"] for card in models}

        assert first.stop() == 0  # the one that was there at the load: the late one serves the adapter alone
        while len((await client.get(base + "/v1/models")).json()["data"]) < 2:
            await asyncio.sleep(0.2)  # until the gateway has heard the late worker
        answer = await client.post(base + "/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert any(e["worker_id"] == "w1" for e in gateway.events_named("request_routed")), gateway.log_tail()


async def test_a_compacted_topic_gives_a_listener_from_the_start_the_latest_state_of_each_key():
    bus = InProcessBus()
    await bus.create_topics({"t.adapters": 1}, compacted=True)
    states = [
        AdapterState(model=MODEL, name=name, path=f"/r/{name}", loaded=loaded, changed_at=at)
        for at, (name, loaded) in enumerate([("a", True), ("b", True), ("a", False)])
    ]
    for state in states:
        await bus.publish("t.adapters", state, key=state.key)
    listener = await bus.listen("t.adapters", from_start=True)
    heard = []
    async for message in listener:
        heard.append(message)
        if len(heard) == 2:
            break
    assert heard == states[1:]  # b, then a's latest: unloaded
