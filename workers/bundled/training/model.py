"""Train the bundled default model from text that ships with Python itself.

The server must answer out of the box on a machine that cannot download
weights, so the project carries its own small Llama: a byte-level BPE
tokenizer of 32000 ids (every token id in MindIE's examples is valid) and a
4-layer model, both trained here on CPython's own text: the tokenizer on the
standard library's source, the model on its English prose (the pydoc topics
and the docstrings). It writes fp16
safetensors of about 22 MB into workers/bundled/model/.

    python -m workers.bundled.training.model --minutes 40

Nothing here runs at serving time; the output is committed.
"""

from __future__ import annotations

import argparse
import ast
import math
import pathlib
import random
import sys
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workers.bundled import BUNDLED_MODEL

OUTPUT_DIR = BUNDLED_MODEL
VOCAB_SIZE = 32000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, Llama's order
# A chat template so the OpenAI chat route works with the bundled model too.
# Tools (OpenAI's, as JSON lines), an assistant's tool calls (<tool_call>{"name", "arguments"}</tool_call>, the
# Hermes format that gateway/structured/tool_calls.py reads back) and tool results ([call id] result) render too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|tools|>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}"
    "{% endfor %}{% endif %}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'tool' %}{{ '[' + message['tool_call_id'] + '] ' }}{% endif %}"
    "{{ message['content'] }}{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}{% endfor %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def stdlib_sources() -> list[str]:
    """The text of every standard-library module (tests and vendored packages left out)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources: list[str] = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib).parts
        if relative[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in relative:
            continue
        try:
            sources.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
    return sources


def stdlib_documents(sources: list[str]) -> list[str]:
    """English prose: the docstrings of the sources plus the pydoc topics, one string each."""
    documents: list[str] = []
    for source in sources:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    documents.append(doc)
    from pydoc_data.topics import topics

    documents.extend(topics[name] for name in sorted(topics))
    return documents


def train_tokenizer(documents: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        sys.exit(f"tokenizer has {tokenizer.get_vocab_size()} ids, not {VOCAB_SIZE}: add text")
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,  # grouped-query attention, as in real Llamas
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def training_batches(token_stream: list[int], seq_len: int, batch_size: int, rng: random.Random):
    starts = list(range(0, len(token_stream) - seq_len - 1, seq_len))
    while True:
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch_size + 1, batch_size):
            rows = [token_stream[s : s + seq_len] for s in starts[i : i + batch_size]]
            yield torch.tensor(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT_DIR)
    args = parser.parse_args()

    torch.manual_seed(0)
    rng = random.Random(0)
    sources = stdlib_sources()
    documents = stdlib_documents(sources)
    print(f"{len(documents)} documents, {sum(map(len, documents)) / 1e6:.1f} M characters", flush=True)
    # The prose alone holds too few distinct words for 32000 merges; code adds the rest.
    tokenizer = train_tokenizer(documents + sources)
    eos = tokenizer.eos_token_id
    token_stream: list[int] = []
    for doc in documents:
        token_stream.extend(tokenizer(doc)["input_ids"] + [eos])
    print(f"{len(token_stream) / 1e6:.2f} M training tokens", flush=True)

    model = LlamaForCausalLM(model_config(tokenizer))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    budget_s = args.minutes * 60
    warmup_s = min(60.0, budget_s / 10)
    started = time.monotonic()
    model.train()
    for step, batch in enumerate(training_batches(token_stream, args.seq_len, args.batch_size, rng)):
        elapsed = time.monotonic() - started
        if elapsed >= budget_s:
            break
        # Schedule by time rather than steps: the budget is what is fixed.
        scale = elapsed / warmup_s if elapsed < warmup_s else 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * max(scale, 0.02)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} {elapsed:.0f}s loss {loss.item():.3f}", flush=True)

    model.eval()
    args.output.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"saved to {args.output}", flush=True)


if __name__ == "__main__":
    main()
