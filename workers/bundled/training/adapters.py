"""Train the bundled model's two LoRA adapters, with PEFT, on text that ships with Python itself.

Multi-LoRA serving needs adapters whose effect a test can see in a dozen
greedy tokens, and that PEFT (the reference the engine is checked against)
wrote. Each is trained on examples of ordinary prose followed by what the
adapter should continue with, the loss on the continuation only, so that
after any English prompt it takes its own voice:

- `shout`: the prose goes on in UPPER CASE (rank 8 on all seven projections);
- `code`: function definitions of the standard library follow, `def
  name(args):` lines (rank 16, rsLoRA, on q, v, o and down only: partial
  targeting and rsLoRA's scaling).

    python -m workers.bundled.training.adapters

It writes workers/bundled/model/adapters/{shout,code}/ (adapter_config.json
and adapter_model.safetensors, float32, under 1 MB each) in a few minutes on
two CPU cores. Nothing here runs at serving time; the output is committed.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import structlog
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from telemetry.logs import configure
from workers.bundled import BUNDLED_ADAPTERS, BUNDLED_MODEL
from workers.bundled.training.model import stdlib_documents, stdlib_sources

log = structlog.get_logger("train_bundled_adapters")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "shout": LoraConfig(r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0),
    "code": LoraConfig(
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        lora_dropout=0.0,
    ),
}
# Upper-case words are a language the base model never saw: its adapter learns them only at a higher rate.
LEARNING_RATES = {"shout": 5e-3, "code": 3e-3}
SEQ_LEN = 48


def examples(name: str, tokenizer, prose: list[str], code: list[str], rng: random.Random):
    """Endless (ids, labels) of SEQ_LEN tokens: a prose opening (not learned), then the adapter's continuation."""
    while True:
        opening = tokenizer(rng.choice(prose), add_special_tokens=True).input_ids[: rng.randint(6, 24)]
        if name == "shout":  # the words of the prose that follows, shouted
            words = rng.choice(prose).split()
            start = rng.randrange(max(1, len(words) - 40))
            follow = tokenizer(" " + " ".join(words[start : start + 40]).upper(), add_special_tokens=False).input_ids
        else:  # the standard library's function definitions
            follow = tokenizer("\n".join(rng.sample(code, 6)), add_special_tokens=False).input_ids
        ids = (opening + follow)[:SEQ_LEN]
        if len(ids) == SEQ_LEN:
            yield ids, [-100] * len(opening) + ids[len(opening) :]


def train(name: str, steps: int, batch_size: int, prose: list[str], code: list[str]) -> None:
    torch.manual_seed(0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    base = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    model = get_peft_model(base, ADAPTERS[name])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATES[name])
    batches = examples(name, tokenizer, prose, code, random.Random(name))
    started = time.monotonic()
    for step in range(1, steps + 1):
        rows = [next(batches) for _ in range(batch_size)]
        ids, labels = (torch.tensor([row[i] for row in rows]) for i in (0, 1))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps:
            log.info(
                "step", adapter=name, step=step, loss=round(loss.item(), 3), seconds=round(time.monotonic() - started)
            )
    output = BUNDLED_ADAPTERS[name]
    model.save_pretrained(output)
    (output / "README.md").unlink(missing_ok=True)  # PEFT's model card template: nothing of ours
    config = json.loads((output / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tokenrelay-tiny"  # not this machine's path
    (output / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log.info("saved", adapter=name, path=str(output), seconds=round(time.monotonic() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per adapter")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--only", choices=sorted(ADAPTERS), help="train this adapter alone")
    args = parser.parse_args()
    configure("info", "train_bundled_adapters")
    sources = stdlib_sources()
    prose = [d for d in stdlib_documents(sources) if len(d) > 400]
    definitions = [
        line.strip() for source in sources for line in source.splitlines() if line.strip().startswith("def ")
    ]
    for name in [args.only] if args.only else ADAPTERS:
        train(name, args.steps, args.batch_size, prose, definitions)


if __name__ == "__main__":
    main()
