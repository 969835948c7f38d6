"""Images for vision-language models (LLaVA, Qwen2-VL and their kin from transformers).

The model's own processor turns a prompt's images into runs of placeholder
tokens and pixel values (`Vision.prepare`). When a step first reaches one of
a sequence's placeholders, the vision tower computes the features of all its
images, for every such sequence of the step at once (`Vision.encode`); the
sequence keeps them until it ends, so a chunk may end anywhere inside a
placeholder run, a preemption recomputes no image, and a block of the prefix
cache that holds placeholders spares its image's rows. The model runner then
puts the features in place of the placeholders' embeddings.

Models with 3-D rotary positions (Qwen2-VL: time, height, width) number an
image's placeholders by their place in the image; the sequence keeps the
three rows of its prompt's positions, and the offset its generated tokens
take (`rope_delta`: the image runs take fewer positions than tokens).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import torch
from PIL import Image


class ImageRefused(ValueError):
    """The images cannot be used with this prompt (the message says why)."""


@dataclass(frozen=True)
class PromptImage:
    start: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens, as many as its feature rows
    digest: bytes  # of its bytes: the prefix cache tells images apart by it


@dataclass
class SequenceImages:
    images: list[PromptImage]
    pixels: dict[str, torch.Tensor]  # what the vision tower takes, for all the prompt's images
    mrope: list[list[int]] | None = None  # 3-D rotary models: the prompt's positions, three rows
    rope_delta: int = 0  # 3-D rotary models: a generated token's position less its index
    features: torch.Tensor | None = None  # [placeholder tokens, hidden], once encoded

    def digests_between(self, start: int, end: int) -> tuple[bytes, ...]:
        """The digests of the images with a placeholder in prompt indices [start, end)."""
        return tuple(i.digest for i in self.images if i.start < end and start < i.start + i.length)

    def feature_rows(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(prompt index, feature row, count) of each placeholder run within [start, end)."""
        runs, row = [], 0
        for image in self.images:
            first, last = max(start, image.start), min(end, image.start + image.length)
            if first < last:
                runs.append((first, row + first - image.start, last - first))
            row += image.length
        return runs

    def positions(self, start: int, end: int, prompt_length: int) -> list[list[int]]:
        """The three rows of positions of tokens [start, end) (3-D rotary models)."""
        assert self.mrope is not None
        rows = [row[start:prompt_length] for row in self.mrope]
        generated = range(max(start, prompt_length) + self.rope_delta, end + self.rope_delta)
        return [row[: end - start] + list(generated) for row in rows]


class Vision:
    """A vision-language model's processor and vision tower, as the engine uses them."""

    def __init__(self, model: torch.nn.Module, processor) -> None:
        self._model = model
        self._processor = processor
        self.tokenizer = processor.tokenizer
        self.chat_template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        config = model.config
        self._image_token_id = config.image_token_id
        self._three_d = hasattr(model.model, "get_rope_index")
        # Raw prompts put this where an image goes; chat templates write their own.
        wrap = [getattr(config, f"vision_{edge}_token_id", None) for edge in ("start", "end")]
        start, end = ("" if i is None else self.tokenizer.convert_ids_to_tokens(i) for i in wrap)
        self.placeholder = f"{start}{processor.image_token}{end}"

    @property
    def image_pixels(self) -> int | None:
        """The most pixels of an image the processor keeps (None: unknown)."""
        images = self._processor.image_processor
        if getattr(images, "merge_size", None):  # the Qwen2-VL family: a budget of pixels
            return int(getattr(images, "max_pixels", None) or images.size["longest_edge"])
        size = images.crop_size if getattr(images, "do_center_crop", False) else images.size
        if size.get("height") and size.get("width"):
            return size["height"] * size["width"]
        edge = size.get("shortest_edge") or size.get("longest_edge")
        return edge * edge if edge else None

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )

    def prepare(self, text: str, images: list[bytes], rendered: bool) -> tuple[list[int], SequenceImages | None]:
        """The prompt's token ids, its placeholders expanded, and what its images need. A `rendered` chat has
        its special tokens (BOS) from the template already: the tokenizer adds none, as for text models."""
        if text.count(self._processor.image_token) != len(images):
            raise ImageRefused(
                f"the prompt has {text.count(self._processor.image_token)} image places for {len(images)} images"
            )
        if not images:
            return self.tokenizer(text, add_special_tokens=not rendered)["input_ids"], None
        try:
            decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        except Exception as error:  # the gateway checked them; a corrupt one still ends here, not the worker
            raise ImageRefused(f"an image cannot be decoded: {error}") from None
        inputs = self._processor(text=text, images=decoded, return_tensors="pt", add_special_tokens=not rendered)
        ids = inputs["input_ids"][0].tolist()
        places = [index for index, token in enumerate(ids) if token == self._image_token_id]
        # Each image's run of placeholders, in order (two images' runs may touch: "<image><image>").
        lengths = self._processor._get_num_multimodal_tokens(image_sizes=[(i.height, i.width) for i in decoded])
        prompt_images, taken = [], 0
        for data, length in zip(images, lengths.num_image_tokens, strict=True):
            digest = hashlib.blake2b(data, digest_size=16).digest()
            prompt_images.append(PromptImage(places[taken], length, digest))
            taken += length
        if taken != len(places):
            raise ImageRefused(f"the images take {taken} placeholder tokens; the prompt has {len(places)}")
        pixels = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        sequence_images = SequenceImages(prompt_images, pixels)
        if self._three_d:
            positions, delta = self._model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw")
            )
            sequence_images.mrope = positions[:, 0].tolist()
            sequence_images.rope_delta = int(delta.item())
        return ids, sequence_images

    @torch.inference_mode()
    def encode(self, pending: list[SequenceImages]) -> None:
        """Compute the features of every image of these sequences, in one pass of the vision tower."""
        tower = self._model.model
        device, dtype = self._model.device, self._model.dtype
        batch = {
            key: torch.cat([p.pixels[key] for p in pending]).to(device, dtype if value.is_floating_point() else None)
            for key, value in pending[0].pixels.items()
        }
        per_image = tower.get_image_features(**batch, return_dict=True).pooler_output
        per_image = iter(per_image)
        for sequence_images in pending:
            features = [next(per_image) for _ in sequence_images.images]
            sequence_images.features = torch.cat(features).to(dtype)
            sequence_images.pixels = {}  # not needed again
