"""The gateway's side of images: checked and scaled before the bus, placed where each API's syntax puts them."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from gateway.errors import ApiError
from gateway.media.images import MAX_DECODED_PIXELS, checked_image
from gateway.media.loader import MediaLoader, MediaRefused
from gateway.media.prompts import multimodal_prompt, tgi_prompt
from gateway.settings import MediaPolicy
from schemas.messages import ImagePart, ServedModel, TextPart
from schemas.multimodal import ImageItem, TextItem


def _png(width: int, height: int, colour=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def _model(image_pixels: int | None) -> ServedModel:
    return ServedModel(
        name="m", aliases=["m"], max_seq_len=64, max_input_len=32, max_iter_times=32, vocab_size=100,
        image_pixels=image_pixels,
    )  # fmt: skip


def test_an_image_within_four_times_the_models_pixels_goes_byte_for_byte():
    small = _png(96, 96)  # 9216 pixels: 4 x 48 x 48
    assert checked_image(small, 48 * 48) == small


def test_a_larger_image_is_scaled_to_four_times_the_models_pixels_keeping_its_shape():
    scaled = Image.open(io.BytesIO(checked_image(_png(1000, 500), 48 * 48)))
    assert scaled.format == "PNG" and scaled.size == (135, 67)  # 135 x 67 <= 4 x 2304, 2:1
    assert scaled.getpixel((60, 30)) == (200, 30, 30)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not an image that can be read"),
        (_png(64, 64)[:80], "not an image that can be read"),  # truncated
        (b"GIF87a" + b"\x00" * 10, "not an image that can be read"),
    ],
)
def test_what_is_not_a_readable_image_is_refused(data, reason):
    with pytest.raises(MediaRefused, match=reason):
        checked_image(data, 48 * 48)


def test_an_image_that_would_decode_to_gigabytes_is_refused_before_decoding():
    header = io.BytesIO()
    Image.new("1", (9000, 8000)).save(header, format="PNG")  # a few kB on disk, 72 M pixels decoded
    with pytest.raises(MediaRefused, match=f"at most {MAX_DECODED_PIXELS} are decoded"):
        checked_image(header.getvalue(), 48 * 48)


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_a_list_with_images_is_one_user_turn_and_a_text_only_list_stays_text(tmp_path):
    media = MediaLoader(MediaPolicy(media_dir=tmp_path))
    image = _png(32, 32)
    items = [TextItem(text="Look:"), ImageItem(image_url=_data_uri(image)), TextItem(text="What colour?")]
    fields = await multimodal_prompt(items, _model(48 * 48), media)
    (turn,) = fields["chat_messages"]
    assert turn.role == "user" and turn.content == [TextPart(text="Look:"), ImagePart(), TextPart(text="What colour?")]
    assert fields["images"] == [image]
    assert await multimodal_prompt([TextItem(text="a"), TextItem(text="b")], _model(None), media) == {
        "prompt_text": "a\nb"
    }
    with pytest.raises(ApiError, match="model m does not accept image input"):
        await multimodal_prompt(items, _model(None), media)


async def test_tgi_markdown_images_are_placed_where_they_stand(tmp_path):
    media = MediaLoader(MediaPolicy(media_dir=tmp_path))
    one, two = _png(20, 20), _png(30, 10, (0, 0, 250))
    inputs = f"![a cat]({_data_uri(one)})What is this? ![]({_data_uri(two)}) And this?"
    fields = await tgi_prompt(inputs, _model(48 * 48), media)
    assert fields["prompt_parts"] == [
        ImagePart(),
        TextPart(text="What is this? "),
        ImagePart(),
        TextPart(text=" And this?"),
    ]
    assert fields["images"] == [one, two]
    assert await tgi_prompt("No ![image here", _model(48 * 48), media) == {"prompt_text": "No ![image here"}
    with pytest.raises(ApiError, match="at most 20 per request"):
        await tgi_prompt(f"![]({_data_uri(one)})" * 21, _model(48 * 48), media)
