"""Distil the bundled model into a 2-layer draft for speculative decoding (--speculative-model).

A draft proposes tokens the target then verifies (workers/engine/speculation.py);
it must share the target's tokenizer, and it pays as far as its greedy choice
agrees with the target's. A copy of the bundled model's first two layers
agrees with it on 36 % of positions; distilled, on what the target reads and
on what it writes itself (the prose it was trained on, and its own greedy
continuations of it), the same two layers agree far more often: the number is
printed at the end, on continuations held out. It starts from those two
layers, the embeddings and the final norm, and minimises the KL divergence
from the target's next-token distribution at every position. Writes fp16
safetensors (about 17 MB) and the target's tokenizer into
workers/bundled/draft_model/.

    python -m workers.bundled.training.draft --minutes 8

Nothing here runs at serving time; the output is committed.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import random
import shutil
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

from workers.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from workers.bundled.training.model import stdlib_documents, stdlib_sources, training_batches

OUTPUT_DIR = BUNDLED_DRAFT_MODEL
LAYERS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def continuations(teacher: LlamaForCausalLM, documents: list[list[int]], count: int, rng: random.Random):
    """The teacher's greedy continuations (128 tokens) of `count` random document openings (32 tokens)."""
    starts = [doc[:32] for doc in rng.sample([d for d in documents if len(d) > 32], count)]
    rows = []
    with torch.inference_mode():
        for i in range(0, count, 16):
            batch = torch.tensor(starts[i : i + 16])
            rows += teacher.generate(batch, max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=3)
    return [row.tolist() for row in rows]


def agreement(teacher: LlamaForCausalLM, draft: LlamaForCausalLM, rows: list[list[int]]) -> float:
    """The share of the generated positions where the draft's greedy token is the teacher's."""
    with torch.inference_mode():
        batch = torch.tensor(rows)
        same = teacher(batch).logits.argmax(-1)[:, 32:] == draft(batch).logits.argmax(-1)[:, 32:]
    return same.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    parser.add_argument("--seq-len", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT_DIR)
    args = parser.parse_args()

    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    teacher = LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    config = copy.deepcopy(teacher.config)  # the teacher's own runs as many layers as its config says
    config.num_hidden_layers = LAYERS
    draft = LlamaForCausalLM(config)
    draft.load_state_dict(teacher.state_dict(), strict=False)  # the first LAYERS layers, embeddings, norm
    eos = tokenizer.eos_token_id
    documents = [tokenizer(doc)["input_ids"] + [eos] for doc in stdlib_documents(stdlib_sources())]
    held_out = continuations(teacher, documents, 32, rng)
    print(f"copied layers agree on {agreement(teacher, draft, held_out):.1%} of held-out positions", flush=True)
    generated = continuations(teacher, documents, 256, rng)
    prose = training_batches([t for doc in documents for t in doc], args.seq_len, args.batch_size, rng)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    budget_s = args.minutes * 60
    started = time.monotonic()
    draft.train()
    for step in range(10**9):
        elapsed = time.monotonic() - started
        if elapsed >= budget_s:
            break
        for group in optimizer.param_groups:
            group["lr"] = args.lr * max(0.5 * (1 + math.cos(math.pi * elapsed / budget_s)), 0.02)
        # Every other batch is the teacher's own text: what a draft sees while the target generates.
        batch = next(prose) if step % 2 else torch.tensor(rng.sample(generated, args.batch_size))
        with torch.no_grad():
            target = teacher(batch).logits.float().log_softmax(-1)
        predicted = draft(batch).logits.float().log_softmax(-1)
        loss = F.kl_div(predicted, target, log_target=True, reduction="batchmean") / batch.shape[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} {elapsed:.0f}s kl {loss.item():.3f}", flush=True)
    draft.eval()
    print(f"distilled layers agree on {agreement(teacher, draft, held_out):.1%} of held-out positions", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    draft.to(torch.float16).save_pretrained(args.output)
    for name in TOKENIZER_FILES:  # the target's, byte for byte
        shutil.copyfile(BUNDLED_MODEL / name, args.output / name)
    print(f"saved to {args.output}", flush=True)


if __name__ == "__main__":
    main()
