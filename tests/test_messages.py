"""The bus's wire format: typed, versioned, JSON."""

import json

import pytest
from pydantic import ValidationError

from schemas.messages import (
    CancelRequest,
    ChatMessage,
    FinishReason,
    GenerationRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    TokenEvent,
    TokenEvents,
    decode,
    encode,
)


def _request(**overrides) -> GenerationRequest:
    fields = dict(
        request_id="r1",
        model="m",
        prompt_text="hello",
        sampling=SamplingParams(seed=7),
        arrival=1.0,
        deadline=2.0,
        reply_to="tokenrelay.replies.g1",
    )
    return GenerationRequest(**{**fields, **overrides})


def test_every_kind_survives_the_wire():
    messages = [
        _request(),
        _request(prompt_text=None, prompt_token_ids=[1, 2, 3], priority=1, attempt=2),
        TokenEvents(
            worker_id="w",
            events=[
                TokenEvent(request_id="r1", index=0, token_ids=[5], text="é", prefill_time_ms=1.5, queue_wait_us=3),
                TokenEvent(request_id="r1", index=1, token_ids=[2], finish_reason=FinishReason.EOS_TOKEN),
            ],
        ),
        CancelRequest(request_id="r1", reason="client gone", deadline=0.0),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def test_seed_keeps_all_64_bits():
    request = _request(sampling=SamplingParams(seed=2**64 - 1))
    assert decode(encode(request)).sampling.seed == 2**64 - 1


def test_a_request_has_exactly_one_prompt():
    one = "exactly one of prompt_text, prompt_token_ids, chat_messages and prompt_parts"
    with pytest.raises(ValidationError, match=one):
        _request(prompt_token_ids=[1])
    with pytest.raises(ValidationError, match=one):
        _request(chat_messages=[ChatMessage(role="user", content="hi")])
    with pytest.raises(ValidationError, match=one):
        _request(prompt_text=None)
    chat = _request(prompt_text=None, chat_messages=[ChatMessage(role="user", content="hi")])
    assert decode(encode(chat)) == chat


def test_images_cross_the_wire_byte_for_byte_and_match_their_places():
    image = bytes(range(256)) * 3
    parts = [TextPart(text="see "), ImagePart(), TextPart(text=" and "), ImagePart()]
    raw = _request(prompt_text=None, prompt_parts=parts, images=[image, b"\x89PNG"])
    assert decode(encode(raw)) == raw and decode(encode(raw)).images[0] == image
    chat = _request(prompt_text=None, chat_messages=[ChatMessage(role="user", content=parts[:2])], images=[image])
    assert decode(encode(chat)) == chat
    with pytest.raises(ValidationError, match="2 image parts for 1 images"):
        _request(prompt_text=None, prompt_parts=parts, images=[image])


def test_unknown_wire_version_is_refused():
    payload = json.loads(encode(CancelRequest(request_id="r1", reason="x", deadline=0.0)))
    payload["v"] = 2
    with pytest.raises(ValidationError):
        decode(json.dumps(payload).encode())


def test_unknown_kind_and_garbage_are_refused():
    with pytest.raises(ValidationError):
        decode(b'{"v": 1, "kind": "reboot"}')
    with pytest.raises(ValidationError):
        decode(b"\x00not json")
