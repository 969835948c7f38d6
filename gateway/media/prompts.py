"""A route's prompt, made into the prompt fields a worker takes, with the images it places loaded and checked.

- MindIE's multimodal lists (`/infer`'s `inputs`, generate's `text_input`):
  text only, the texts joined by newlines, as before; with images, one user
  turn of a chat whose parts are the list's items in order, rendered by the
  model's chat template, which places each image as the model was trained to
  see it (as MindIE does for its vision-language models).
- OpenAI chat messages: image_url content parts are parts of their turn.
- TGI's `inputs`: a raw prompt, where `![](url)` places an image (TGI's syntax).

Images are loaded as loader.py allows, checked and scaled by images.py, and
travel in the request's `images`. A model that takes none answers 422
naming itself and the media type; video and audio, which no worker serves,
likewise.
"""

from __future__ import annotations

import asyncio
import re

from gateway.errors import unprocessable
from gateway.media.images import checked_image
from gateway.media.loader import MediaLoader, MediaRefused
from schemas.messages import ChatMessage, ContentPart, ImagePart, ServedModel, TextPart
from schemas.multimodal import MAX_ITEMS, TextItem, media_reference
from schemas.openai import ChatMessageIn

PromptFields = dict  # GenerationRequest's prompt fields: prompt_text, prompt_parts or chat_messages; images
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


async def load_image(kind: str, reference: str, model: ServedModel, media: MediaLoader) -> bytes:
    """One media item, loaded and checked for the model; 422 if the model cannot take it."""
    try:
        data = await media.load(kind, reference)
        if kind != "image_url" or model.image_pixels is None:
            raise MediaRefused(f"model {model.name} does not accept {kind.removesuffix('_url')} input")
        return await asyncio.to_thread(checked_image, data, model.image_pixels)
    except MediaRefused as refused:
        raise unprocessable(str(refused)) from None


async def multimodal_prompt(text_input: str | list, model: ServedModel, media: MediaLoader) -> PromptFields:
    """MindIE's `inputs` / `text_input`: a string, or a list of text and media items."""
    if isinstance(text_input, str):
        return {"prompt_text": text_input}
    if all(isinstance(item, TextItem) for item in text_input):
        return {"prompt_text": "\n".join(item.text for item in text_input)}
    parts: list[ContentPart] = []
    images: list[bytes] = []
    for item in text_input:
        if isinstance(item, TextItem):
            parts.append(TextPart(text=item.text))
        else:
            images.append(await load_image(item.type, media_reference(item), model, media))
            parts.append(ImagePart())
    return {"chat_messages": [ChatMessage(role="user", content=parts)], "images": images}


async def chat_prompt(messages: list[ChatMessageIn], model: ServedModel, media: MediaLoader) -> PromptFields:
    """OpenAI's messages, with the images of their image_url parts."""
    images = [await load_image("image_url", url, model, media) for m in messages for url in m.image_urls]
    return {"chat_messages": [m.as_message() for m in messages], "images": images}


async def tgi_prompt(inputs: str, model: ServedModel, media: MediaLoader) -> PromptFields:
    """TGI's `inputs`: text, where each `![alt](url)` places an image."""
    urls = _MARKDOWN_IMAGE.findall(inputs)
    if not urls:
        return {"prompt_text": inputs}
    if len(urls) > MAX_ITEMS:
        raise unprocessable(f"inputs: {len(urls)} images; at most {MAX_ITEMS} per request")
    parts: list[ContentPart] = []
    for index, text in enumerate(_MARKDOWN_IMAGE.split(inputs)):
        if index % 2:  # split keeps the captured URL between the texts
            parts.append(ImagePart())
        elif text:
            parts.append(TextPart(text=text))
    return {"prompt_parts": parts, "images": [await load_image("image_url", url, model, media) for url in urls]}
