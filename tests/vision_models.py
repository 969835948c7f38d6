"""Tiny randomly initialised vision-language models (LLaVA, Qwen2-VL) with their processors, for exactness tests.

Built from configs, in the dtype asked for, around the bundled model's
tokenizer with the image tokens each family needs; nothing is downloaded.
"""

from __future__ import annotations

import base64
import io

import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaProcessor,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from workers.bundled import BUNDLED_MODEL
from workers.engine.model_loader import LoadedModel, random_model

FAMILIES = ("llava", "qwen2_vl")
_IMAGE_TOKENS = ["<image>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)


def _tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    tokenizer.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS})
    return tokenizer


def _llava(tokenizer):
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        text_config=LlamaConfig(vocab_size=len(tokenizer), **_TEXT),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    return config, processor


def _qwen2_vl(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            **_TEXT,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        bos_token_id=1,
        eos_token_id=2,
    )
    images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=140 * 140)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())
    return config, processor


def tiny_vlm(family: str, dtype: str = "float64", device: str = "cpu", seed: int = 0) -> LoadedModel:
    """A random model of the family; the same seed gives the same weights."""
    tokenizer = _tokenizer()
    config, processor = {"llava": _llava, "qwen2_vl": _qwen2_vl}[family](tokenizer)
    torch.manual_seed(seed)
    loaded = random_model(config, tokenizer, device, dtype, processor=processor)
    loaded.model.generation_config.eos_token_id = 2
    return loaded


def drawn_image(width: int, height: int, colour: tuple[int, int, int], seed: int) -> bytes:
    """A PNG with a gradient and a square: images that differ give different features."""
    generator = torch.Generator().manual_seed(seed)
    noise = (torch.rand(height, width, 3, generator=generator) * 255).to(torch.uint8)
    image = Image.fromarray(noise.numpy())
    image.paste(colour, (width // 4, height // 4, width // 2, height // 2))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_uri(image: Image.Image) -> str:
    """A picture as a request carries it: a PNG in a data: URI."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def reference_tokens(loaded: LoadedModel, text: str, images: list[bytes], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` for one request, up to and with its EOS."""
    decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = loaded.processor(text=text, images=decoded or None, return_tensors="pt").to(loaded.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(loaded.model.dtype)
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = next((i for i, t in enumerate(tokens) if t in loaded.eos_token_ids), None)
    return tokens if eos is None else tokens[: eos + 1]
