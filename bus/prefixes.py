"""Prompt prefix hashes: the names gateways and workers give to the prompt prefixes a worker has cached.

Gateways do not tokenize, so the names come from the request as published:
its prompt (text, chat messages or token ids; an image as a digest of its
bytes, where it stands) read as one byte string, cut
into CHUNK_BYTES pieces, each piece hashed together with the hash of all
before it (the first with the LoRA adapter's name, if it has one), as a KV
cache names its blocks. Two prompts that start alike
share their first hashes; a conversation's next turn, which resends the
history, shares every hash of the turn before. Only whole pieces are named.
"""

from __future__ import annotations

import hashlib

from schemas.messages import ContentPart, GenerationRequest, TextPart

CHUNK_BYTES = 256  # about 64 tokens of English: a few KV blocks


def prompt_bytes(request: GenerationRequest) -> bytes:
    images = iter(request.images)

    def text(content: str | list[ContentPart]) -> str:
        if isinstance(content, str):
            return content
        return "".join(
            p.text if isinstance(p, TextPart) else hashlib.blake2b(next(images)).hexdigest() for p in content
        )

    if request.chat_messages is not None:
        return "".join(f"\x1e{m.role}\x1f{text(m.content)}" for m in request.chat_messages).encode()
    if request.prompt_token_ids is not None:
        return ",".join(map(str, request.prompt_token_ids)).encode()
    if request.prompt_parts is not None:
        return text(request.prompt_parts).encode()
    return (request.prompt_text or "").encode()


def prefix_hashes(request: GenerationRequest, data: bytes | None = None) -> list[int]:
    """One hash per whole CHUNK_BYTES of the prompt; none when the prompt is truncated from the left. `data`: its
    prompt_bytes, where the caller has them already (they hash each image)."""
    if request.truncate is not None:
        return []  # its kept tokens are the last ones: no prefix to name
    data = prompt_bytes(request) if data is None else data
    # A prefix computed under an adapter is another one's than the base model's: its names start apart.
    hashes, previous = [], b"" if request.adapter is None else f"adapter\x1f{request.adapter}".encode()
    for end in range(CHUNK_BYTES, len(data) + 1, CHUNK_BYTES):
        previous = hashlib.blake2b(previous + data[end - CHUNK_BYTES : end], digest_size=6).digest()
        hashes.append(int.from_bytes(previous))
    return hashes
