"""The engine with vision-language models: exact tokens with images in the batch, and a prefix cache keyed by image.

Tiny random LLaVA and Qwen2-VL models in float64 (tests/vision_models.py):
every request must draw, token for token, what transformers' own `generate`
draws for it alone, while image and text-only requests share steps, arrive
at staggered times, are cut into small prompt chunks (inside image runs
too) and preempted.
"""

from __future__ import annotations

import time
import uuid

import pytest

from schemas.messages import ImagePart, SamplingParams, TextPart
from tests.test_engine import Harness
from tests.vision_models import FAMILIES, drawn_image, reference_tokens, tiny_vlm
from workers.engine.config import EngineConfig
from workers.engine.request import EngineRequest

PLACEHOLDER = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 8  # K and V, layers, block size, KV heads, head dim, float64


def submit(h: Harness, parts: list, max_new_tokens: int, priority: int = 5) -> str:
    """A raw prompt of text pieces and images (bytes), as TGI's ![](url) makes one."""
    request_id = uuid.uuid4().hex
    now = time.time()
    prompt = [TextPart(text=p) if isinstance(p, str) else ImagePart() for p in parts]
    h.engine.submit(
        EngineRequest(
            request_id=request_id,
            model="m",
            prompt_parts=prompt,
            images=[p for p in parts if isinstance(p, bytes)],
            sampling=SamplingParams(seed=1, max_new_tokens=max_new_tokens),
            priority=priority,
            deadline=now + 300,
        ),
        time.monotonic(),
    )
    return request_id


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(family: str, parts: list) -> str:
    return "".join(p if isinstance(p, str) else PLACEHOLDER[family] for p in parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_and_text_requests_in_one_batch_equal_transformers_generate(family):
    engine_model, reference = tiny_vlm(family), tiny_vlm(family)
    red, green, wide = drawn_image(40, 30, (250, 0, 0), 1), drawn_image(64, 64, (0, 250, 0), 2), None
    wide = drawn_image(120, 50, (0, 0, 250), 3)
    workload = [
        (["Describe ", red, " in a few words, please."], 12, 5),
        (["Describe ", green, " in a few words, please."], 12, 5),
        (["A text-only request among the images, long enough to be chunked: " * 2], 10, 5),
        (["Compare ", red, " and ", wide, " and say which is wider."], 10, 5),
        ([wide, " first, then text."], 8, 5),
        (["Urgent: ", green, " now."], 6, 1),  # arrives last, preempts
        ([red, green, " touching images."], 6, 5),
    ]
    # Prompt chunks of 16 tokens cut image runs; a cache of 5 blocks holds two requests at a time.
    h = Harness(engine_model, EngineConfig(max_seq_len=160, max_tokens_per_step=16, kv_cache_bytes=5 * BLOCK_BYTES))
    try:
        ids = [submit(h, parts, n, prio) for parts, n, prio in workload[:3]]
        h.wait_for_tokens(ids[0], 3)
        ids += [submit(h, parts, n, prio) for parts, n, prio in workload[3:5]]
        h.wait_for_tokens(ids[3], 2)
        ids += [submit(h, parts, n, prio) for parts, n, prio in workload[5:]]
        results = h.collect(ids)
        stats = h.engine.stats()
    finally:
        h.close()
    for request_id, (parts, max_new, _) in zip(ids, workload, strict=True):
        images = [p for p in parts if isinstance(p, bytes)]
        expected = reference_tokens(reference, text_of(family, parts), images, max_new)
        assert tokens(results[request_id]) == expected, (family, parts[:2])
    assert stats["preemptions"] > 0, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_cache_reuses_an_images_blocks_for_the_same_image_only(family):
    loaded = tiny_vlm(family)
    first, other = drawn_image(64, 64, (250, 0, 0), 4), drawn_image(64, 64, (250, 0, 0), 5)
    question = " What is in this picture? Answer with care, and at some length, so the prompt fills blocks." * 2
    h = Harness(loaded, EngineConfig(max_seq_len=512, kv_cache_bytes=64 * BLOCK_BYTES))
    try:
        reuses = []
        for image in (first, first, other):
            before = h.engine.stats()["reused_tokens"]
            request_id = submit(h, [image, question], 4)
            prompt_tokens = h.collect([request_id])[request_id][0].prompt_tokens
            reuses.append(h.engine.stats()["reused_tokens"] - before)
    finally:
        h.close()
    whole_blocks = (prompt_tokens - 1) // 32 * 32  # all but the last token's block: its logits are computed
    assert whole_blocks >= 32
    assert reuses == [0, whole_blocks, 0]  # the image is in the first block: nothing after it matches either
