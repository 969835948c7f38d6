"""Multimodal input: `text_input` (generate, generate_stream) or `inputs` (/infer) given as a list.

Items are `{"type": "text", "text": ...}` or `{"type": "image_url" | "video_url" |
"audio_url", "<type>": "<data: URI, path under the media directory, or http(s) URL>"}`.
`type` may be left out when the item's one content key says it. Whether the
field is a text or a list is told from its value (a callable discriminator),
so that a wrong value's error is that form's alone, not both forms' at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from schemas.body import Body
from schemas.parameters import STRICT

MAX_ITEMS = 20
MEDIA_KINDS = ("image_url", "video_url", "audio_url")


class TextItem(Body):
    model_config = STRICT
    type: Literal["text"] = "text"
    text: str = Field(min_length=1)


class ImageItem(Body):
    model_config = STRICT
    type: Literal["image_url"] = "image_url"
    image_url: str = Field(min_length=1, description="JPG or PNG; at most 40 MB.")


class VideoItem(Body):
    model_config = STRICT
    type: Literal["video_url"] = "video_url"
    video_url: str = Field(min_length=1, description="MP4, AVI or WMV; at most 512 MB.")


class AudioItem(Body):
    model_config = STRICT
    type: Literal["audio_url"] = "audio_url"
    audio_url: str = Field(min_length=1, description="MP3, WAV or FLAC; at most 40 MB.")


MediaItem = ImageItem | VideoItem | AudioItem


def _kind(item) -> str | None:
    if not isinstance(item, dict):
        return getattr(item, "type", None)
    if "type" in item:
        return item["type"] if isinstance(item["type"], str) else None
    present = [key for key in ("text", *MEDIA_KINDS) if key in item]
    return present[0] if len(present) == 1 else None


MultimodalItem = Annotated[
    Annotated[TextItem, Tag("text")]
    | Annotated[ImageItem, Tag("image_url")]
    | Annotated[VideoItem, Tag("video_url")]
    | Annotated[AudioItem, Tag("audio_url")],
    Discriminator(_kind),
]
MultimodalInput = Annotated[list[MultimodalItem], Field(min_length=1, max_length=MAX_ITEMS)]


def _text_or_items(value: Any) -> str | None:
    return "string" if isinstance(value, str) else "list" if isinstance(value, list) else None


def text_or_items(max_characters: int) -> Any:
    """A prompt given as a text of 1 to `max_characters` characters, or as a multimodal list."""
    return Annotated[
        Annotated[str, Field(min_length=1, max_length=max_characters), Tag("string")]
        | Annotated[MultimodalInput, Tag("list")],
        Discriminator(
            _text_or_items,
            custom_error_type="text_or_items",
            custom_error_message="Input should be a text or a list of text and media items",
        ),
    ]


def media_reference(item: MediaItem) -> str:
    return getattr(item, item.type)
