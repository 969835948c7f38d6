"""The bundled vision-language model served: it sees held-out pictures, through every API that carries one.

`tokenrelay serve --vision` serves workers/bundled/vision_model/ (trained by
workers/bundled/training/vision_model.py). Pictures are drawn here with another
seed than training's; each goes as a data: URI. Greedy answers must be right
at least 90 % of the time through generate, and the same picture and question
must get the same text through /infer, the OpenAI SDK's chat and the WebSocket.
The server's bus carries at most 20 000 bytes per message here, so that a
picture too large for it is refused (413) before it is published.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest
import websockets
from PIL import Image

from tests.processes import serving
from tests.vision_models import data_uri
from workers.bundled import BUNDLED_VISION_MODEL_NAME as MODEL
from workers.bundled.training.vision_model import draw_example

HELD_OUT_SEED = 90210  # training draws with 0, its own evaluation with 1_000_003
EXAMPLES = 100
MESSAGE_LIMIT = 20_000


def items(uri: str, question: str) -> list[dict]:
    """MindIE's multimodal list."""
    return [{"type": "image_url", "image_url": uri}, {"type": "text", "text": question}]


def chat_content(uri: str, question: str) -> list[dict]:
    """OpenAI's content parts."""
    return [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": question}]


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vision")
    with serving(log_dir, "--vision", "--max-message-bytes", str(MESSAGE_LIMIT), model=MODEL) as served:
        yield served


def test_held_out_pictures_are_answered_right_and_alike_through_every_api(vision_server):
    rng = random.Random(HELD_OUT_SEED)
    examples = [draw_example(rng) for _ in range(EXAMPLES)]
    greedy = {"max_new_tokens": 5, "do_sample": False}
    answers = []
    with httpx.Client(timeout=60) as client:
        for image, question, _ in examples:
            body = {"text_input": items(data_uri(image), question), "parameters": greedy}
            answer = client.post(vision_server.url(f"/v2/models/{MODEL}/generate"), json=body)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json()["text_output"])
        right = sum(a.strip() == expected for a, (_, _, expected) in zip(answers, examples, strict=True))
        assert right >= 0.9 * EXAMPLES, list(zip(answers, [e[2] for e in examples], strict=True))

        sdk = openai.OpenAI(base_url=vision_server.url("/v1"), api_key="none")
        for (image, question, _), expected in list(zip(examples, answers, strict=True))[:4]:
            uri = data_uri(image)
            infer = client.post(
                vision_server.url("/infer"), json={"inputs": items(uri, question), "parameters": greedy}
            )
            assert infer.json()["generated_text"] == expected
            chat = sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": chat_content(uri, question)}],
                max_tokens=5,
                temperature=0,
            )
            assert chat.choices[0].message.content == expected
            assert asyncio.run(_over_websocket(vision_server, uri, question)) == (expected, expected)


async def _over_websocket(served, uri: str, question: str) -> tuple[str, str]:
    """The answer through the WebSocket's generate_stream and chat.completions ops, streamed side by side."""
    messages = [{"role": "user", "content": chat_content(uri, question)}]
    texts = {"g": "", "c": ""}
    async with websockets.connect(served.base_url.replace("http", "ws") + "/ws") as socket:
        await socket.send(
            json.dumps({"op": "generate_stream", "id": "g", "model": MODEL, "text_input": items(uri, question),
                        "parameters": {"max_new_tokens": 5, "do_sample": False}})
        )  # fmt: skip
        await socket.send(
            json.dumps({"op": "chat.completions", "id": "c",
                        "body": {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}})
        )  # fmt: skip
        done: set[str] = set()
        while done != {"g", "c"}:
            message = json.loads(await asyncio.wait_for(socket.recv(), 60))
            if message.get("done"):
                done.add(message["id"])
            elif message["id"] == "g":
                texts["g"] += message["data"]["text_output"]
            else:
                texts["c"] += message["data"]["choices"][0]["delta"].get("content") or ""
    return texts["g"], texts["c"]


def test_tgi_places_a_markdown_image_in_a_raw_prompt(vision_server):
    """The chat template's text written by hand, the image where the template puts it: the same tokens, the
    same answer as the chat rendering of the MindIE list (the tokenizer adds the BOS the template writes)."""
    image, question, _ = draw_example(random.Random(7))
    uri = data_uri(image)
    prompt = f"<|user|>\n![]({uri}){question}\n<|assistant|>\n"
    greedy = {"max_new_tokens": 5, "do_sample": False}
    with httpx.Client(timeout=60) as client:
        tgi = client.post(vision_server.url("/generate"), json={"inputs": prompt, "parameters": greedy})
        mindie = client.post(
            vision_server.url(f"/v2/models/{MODEL}/generate"),
            json={"text_input": items(uri, question), "parameters": greedy},
        )
    assert tgi.status_code == 200, tgi.text
    assert tgi.json()["generated_text"] == mindie.json()["text_output"]


def test_limits_on_images(vision_server):
    noise = Image.frombytes("RGB", (96, 96), random.Random(3).randbytes(96 * 96 * 3))  # 96 x 96 is kept as it is
    too_large = httpx.post(
        vision_server.url(f"/v2/models/{MODEL}/generate"), json={"text_input": items(data_uri(noise), "What?")}
    )
    assert too_large.status_code == 413, too_large.text
    assert f"at most {MESSAGE_LIMIT} are carried (--max-message-bytes)" in too_large.json()["error"]
    small = data_uri(draw_example(random.Random(1))[0])
    many = httpx.post(vision_server.url("/infer"), json={"inputs": [{"type": "image_url", "image_url": small}] * 21})
    assert many.status_code == 422
    not_an_image = httpx.post(
        vision_server.url("/infer"),
        json={"inputs": [{"type": "image_url", "image_url": "data:image/png;base64,aGVsbG8="}]},
    )
    assert not_an_image.status_code == 422 and "not an image that can be read" in not_an_image.json()["error"]
    video = httpx.post(
        vision_server.url("/infer"),
        json={"inputs": [{"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}]},
    )
    assert video.status_code == 422 and video.json()["error"] == f"model {MODEL} does not accept video input"
