"""Train the bundled vision-language model on pictures it draws itself.

The server's image routes need a model that really looks at an image, and the
project cannot download one, so it carries a tiny LLaVA: a CLIP vision tower
(48 x 48 pixels, 3 layers) trained here from scratch, LLaVA's two-layer
projector, and the bundled text model (workers/bundled/model/) as its language
model, with one added token, `<image>` (id 32000). The pictures are drawn with
PIL: one to three shapes of one kind and colour on a plain background. Four
questions about them (QUESTIONS: colour, shape, count, position) are answered
in one word and the end of sequence.

Training has two stages, both on freshly drawn pictures. First the tower and
projector alone learn the four properties as classes (cheap steps, no language
model); then the whole model learns the chats, with the loss on the answer
only. After training, the script asks held-out pictures (drawn from another
seed) through the processor and `generate`, as a caller would, saves float16
weights, loads them back and asks again, logging the accuracy of each type:

    python -m workers.bundled.training.vision_model --minutes 9

It writes the model and the processor (chat template included) into
workers/bundled/vision_model/, loadable with AutoModelForImageTextToText and
AutoProcessor. Nothing here runs at serving time; the output is committed.
Tests draw their own pictures with `draw_example` and `QUESTIONS`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

import torch
from PIL import Image, ImageDraw

from workers.bundled import BUNDLED_MODEL, BUNDLED_VISION_MODEL

log = logging.getLogger("train_bundled_vision_model")

TEXT_MODEL_DIR = BUNDLED_MODEL
OUTPUT_DIR = BUNDLED_VISION_MODEL

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 48  # what the tower sees: 6 x 6 patches of 8 pixels, 36 image tokens per picture
PATCH_SIZE = 8
DRAW_SIZE = 2 * IMAGE_SIZE  # drawn larger, so the processor's resize smooths the edges as it would a photo's

COLORS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (240, 200, 0)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
BACKGROUNDS = ((255, 255, 255), (225, 225, 225))
QUESTIONS = {
    "color": "What color is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
    "position": "Where is the shape?",
}

ANSWERS = {"color": list(COLORS), "shape": list(SHAPES), "count": ["1", "2", "3"], "position": list(POSITIONS)}


def chat_template() -> str:
    """The text model's template, where a message's content may also be a list of parts.

    A text part renders its text and an image part (OpenAI's "image_url" too) the
    image token, which the processor widens to one token per image feature.
    """
    from workers.bundled.training.model import CHAT_TEMPLATE

    plain = "{{ message['content'] }}"
    parts = (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% elif message['content'] is iterable %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ('image', 'image_url') %}{{ '" + IMAGE_TOKEN + "' }}{% endif %}"
        "{% endfor %}"
        # Anything else (None) renders as the text model's template renders it.
        "{% else %}{{ message['content'] }}{% endif %}"
    )
    if CHAT_TEMPLATE.count(plain) != 1:
        raise RuntimeError("the text model's chat template no longer renders content as expected")
    return CHAT_TEMPLATE.replace(plain, parts)


# --- pictures ---------------------------------------------------------------------------------------------


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # pointing up, as wide as it is high
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _centres(rng: random.Random, count: int, side: float, position: str | None) -> list[tuple[float, float]]:
    """Centres for `count` shapes of `side` pixels that do not touch; `position` places a single one."""
    low, high = side / 2 + 2, DRAW_SIZE - side / 2 - 2
    if position is not None:
        near, middle = (low, 0.3 * DRAW_SIZE), (0.4 * DRAW_SIZE, 0.6 * DRAW_SIZE)
        x_range, y_range = {
            "left": (near, middle),
            "right": ((DRAW_SIZE - near[1], high), middle),
            "top": (middle, near),
            "bottom": (middle, (DRAW_SIZE - near[1], high)),
        }[position]
        return [(rng.uniform(*x_range), rng.uniform(*y_range))]
    # Apart by 3 pixels of the tower's 48 at least, so that shapes side by side still count as two.
    gap = side + 3 * DRAW_SIZE / IMAGE_SIZE
    while True:  # rejection: three shapes of at most a third of the side fit easily
        centres = [(rng.uniform(low, high), rng.uniform(low, high)) for _ in range(count)]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) > gap for i, a in enumerate(centres) for b in centres[i + 1 :]):
            return centres


def _render(rng: random.Random, shape: str, color: str, count: int, position: str | None) -> Image.Image:
    """`count` shapes of one kind and colour on a white or light grey background."""
    image = Image.new("RGB", (DRAW_SIZE, DRAW_SIZE), rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    # Sizes vary little, so that how much of the picture is coloured says how many shapes there are.
    side = rng.uniform(0.24, 0.30) * DRAW_SIZE
    for cx, cy in _centres(rng, count, side, position):
        _draw_shape(draw, shape, (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2), COLORS[color])
    return image


def draw_scene(rng: random.Random, placed: bool) -> tuple[Image.Image, dict[str, str]]:
    """A picture and the answer to each question of QUESTIONS it has one for.

    A `placed` scene is a single shape at one side (all four answers); any other is one to three
    shapes anywhere, which has no position.
    """
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    position = rng.choice(POSITIONS) if placed else None
    count = 1 if placed else rng.randint(1, 3)
    answers = {"color": color, "shape": shape, "count": str(count)}
    if position is not None:
        answers["position"] = position
    return _render(rng, shape, color, count, position), answers


def draw_example(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A picture, one of QUESTIONS' questions about it (each as likely) and its one-word answer."""
    kind = rng.choice(list(QUESTIONS))
    image, answers = draw_scene(rng, placed=kind == "position")
    return image, QUESTIONS[kind], answers[kind]


def user_message(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


# --- model ------------------------------------------------------------------------------------------------


def build_processor():
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(TEXT_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    template = chat_template()
    tokenizer.chat_template = template  # the server renders chats with the tokenizer alone
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which "default" then drops again
        chat_template=template,
    )


def build_model(tokenizer):
    """LLaVA around the bundled text model's weights and a new, tiny CLIP tower."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    text_config = LlamaConfig.from_pretrained(TEXT_MODEL_DIR)  # float16, as saved, and no local path in it
    text_config.vocab_size = len(tokenizer)  # 32001: <image> is the last id
    vision_config = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    # Trained in float32: the text config says float16 (as saved), which the constructor would follow.
    model = LlavaForConditionalGeneration(config).to(torch.float32)

    text_model = LlamaForCausalLM.from_pretrained(TEXT_MODEL_DIR, dtype=torch.float32)
    # The <image> row is never looked up (image features replace it), so its start hardly matters.
    text_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to the input embeddings")
    model.generation_config.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


# --- training ---------------------------------------------------------------------------------------------


def _descend(loss: torch.Tensor, model, optimizer, smoothed: float | None) -> float:
    """One optimizer step on `loss` (gradients clipped); the loss's running average."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()


def lr_scale(elapsed: float, budget_s: float) -> float:
    """Warm up, then a cosine down to 2 %; by time rather than steps, as the text model's training: the
    budget is what is fixed."""
    warmup_s = min(30.0, budget_s / 10)
    scale = elapsed / warmup_s if elapsed < warmup_s else 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
    return max(scale, 0.02)


def _probe_accuracy(probes, pooled: torch.Tensor, labels: dict[str, list[int]]) -> str:
    """The probes' accuracy on one batch, per question type: how well the tower sees, while it trains."""
    scores = []
    for kind, probe in probes.items():
        truth = torch.tensor(labels[kind])
        known = truth != -100
        right = (probe(pooled).argmax(-1) == truth)[known].float().mean().item()
        scores.append(f"{kind} {right:.0%}")
    return " ".join(scores)


def pretrain_tower(model, processor, rng: random.Random, args: argparse.Namespace) -> None:
    """Stage 1: the tower and projector alone learn to tell every answer, through linear probes on the mean
    of the projected image features (thrown away afterwards).

    A step here costs a twentieth of one through the language model, and a tower that already sees makes
    the language model's part, learning to read it, short: LLaVA's own recipe starts from a trained CLIP.
    """
    width = model.config.text_config.hidden_size
    probes = torch.nn.ModuleDict({kind: torch.nn.Linear(width, len(values)) for kind, values in ANSWERS.items()})
    parts = [model.model.vision_tower, model.model.multi_modal_projector, probes]
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=args.tower_lr, weight_decay=0.01)
    budget_s = args.minutes * 60 * args.tower_share
    started = time.monotonic()
    step, smoothed = 0, None
    while (elapsed := time.monotonic() - started) < budget_s:
        for group in optimizer.param_groups:
            group["lr"] = args.tower_lr * lr_scale(elapsed, budget_s)
        images, labels = [], {kind: [] for kind in ANSWERS}
        for _ in range(args.tower_batch_size):
            image, answers = draw_scene(rng, placed=rng.random() < 0.5)
            images.append(image)
            for kind, values in ANSWERS.items():
                labels[kind].append(values.index(answers[kind]) if kind in answers else -100)
        pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
        pooled = torch.stack(model.model.get_image_features(pixel_values=pixel_values).pooler_output).mean(1)
        losses = {
            kind: torch.nn.functional.cross_entropy(probe(pooled), torch.tensor(labels[kind]))
            for kind, probe in probes.items()
        }
        smoothed = _descend(sum(losses.values()), model, optimizer, smoothed)
        if step % 200 == 0:
            accuracy = _probe_accuracy(probes, pooled, labels)
            log.info("tower step %d  %.0fs  loss %.3f  %s", step, elapsed, smoothed, accuracy)
        step += 1
    log.info("tower: %d steps of %d pictures in %.0fs, loss %.3f", step, args.tower_batch_size, elapsed, smoothed)


class Batches:
    """Training batches drawn on the fly: pixel values, token ids, and which positions predict the answer.

    A prompt depends only on the question, so the 4 of them are tokenized once, through the processor
    (which widens <image>). Each comes twice: with one BOS, as the tokenizer's apply_chat_template gives
    it, and with two, as processor(text=rendered_chat) gives it (the template writes one, the tokenizer
    adds one); callers use both.
    """

    def __init__(self, processor, rng: random.Random):
        self.processor, self.rng = processor, rng
        tokenizer = processor.tokenizer
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        blank = Image.new("RGB", (DRAW_SIZE, DRAW_SIZE), BACKGROUNDS[0])
        self.prompts: dict[str, list[list[int]]] = {}
        for question in QUESTIONS.values():
            text = processor.apply_chat_template(user_message(question), add_generation_prompt=True, tokenize=False)
            double = processor(text=text, images=[blank])["input_ids"][0]
            single = processor(text=text, images=[blank], add_special_tokens=False)["input_ids"][0]
            self.prompts[question] = [single, double]
        self.answer_ids: dict[str, list[int]] = {}

    def answer(self, text: str) -> list[int]:
        if text not in self.answer_ids:
            self.answer_ids[text] = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.answer_ids[text]

    def __call__(self, size: int) -> dict[str, torch.Tensor]:
        images, rows, targets = [], [], []
        for _ in range(size):
            image, question, answer = draw_example(self.rng)
            images.append(image)
            prompt = self.rng.choice(self.prompts[question])
            target = self.answer(answer) + [self.eos]
            rows.append(prompt + target)
            targets.append((len(prompt), target))
        width = max(map(len, rows))
        input_ids = torch.full((size, width), self.pad)
        attention_mask = torch.zeros((size, width), dtype=torch.long)
        targets_at = torch.full((size, width), -100)  # the token each position must predict; -100: none
        for i, (row, (start, target)) in enumerate(zip(rows, targets, strict=True)):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1
            # Position p predicts token p + 1: the last prompt position predicts the answer's first token.
            targets_at[i, start - 1 : start - 1 + len(target)] = torch.tensor(target)
        pixel_values = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "targets": targets_at,
        }


def answer_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy at the answer positions only: the 32001-way head runs on those few rows alone."""
    hidden = model.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"]
    ).last_hidden_state
    where = batch["targets"] != -100
    logits = model.lm_head(hidden[where])
    return torch.nn.functional.cross_entropy(logits, batch["targets"][where])


def train(model, processor, rng: random.Random, args: argparse.Namespace) -> None:
    """Stage 2: the whole model, on the chats, with the loss on the answers."""
    batches = Batches(processor, rng)
    # The tower goes on learning, more slowly; the language model has to learn to read it.
    groups = [
        (model.model.language_model.parameters(), args.lm_lr),
        ([*model.model.vision_tower.parameters(), *model.model.multi_modal_projector.parameters()], args.lr),
    ]
    optimizer = torch.optim.AdamW(
        [{"params": list(params), "lr": lr, "base_lr": lr} for params, lr in groups], weight_decay=0.01
    )
    budget_s = args.minutes * 60 * (1 - args.tower_share)
    started = time.monotonic()
    model.train()
    step, smoothed = 0, None
    while (elapsed := time.monotonic() - started) < budget_s:
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_scale(elapsed, budget_s)
        smoothed = _descend(answer_loss(model, batches(args.batch_size)), model, optimizer, smoothed)
        if step % 100 == 0:
            log.info("step %d  %.0fs  loss %.3f", step, elapsed, smoothed)
        step += 1
    log.info("whole model: %d steps of %d chats in %.0fs, loss %.3f", step, args.batch_size, elapsed, smoothed)
    model.eval()


# --- evaluation -------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, processor, seed: int, examples: int) -> dict[str, float]:
    """Accuracy per question type, asked as a caller would: chat template, processor, greedy generate."""
    rng = random.Random(seed)
    kinds = {question: kind for kind, question in QUESTIONS.items()}
    right: dict[str, int] = dict.fromkeys(QUESTIONS, 0)
    asked: dict[str, int] = dict.fromkeys(QUESTIONS, 0)
    for _ in range(examples):
        image, question, answer = draw_example(rng)
        prompt = processor.apply_chat_template(user_message(question), add_generation_prompt=True, tokenize=False)
        inputs = processor(text=prompt, images=[image], return_tensors="pt").to(model.dtype)
        output = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        reply = processor.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        kind = kinds[question]
        asked[kind] += 1
        right[kind] += reply == answer
    accuracy = {kind: right[kind] / asked[kind] for kind in QUESTIONS if asked[kind]}
    accuracy["overall"] = sum(right.values()) / sum(asked.values())
    return accuracy


def check_processor(model, processor) -> None:
    """The processor widens <image> to one placeholder per image feature, and generate runs on it."""
    image, question, _ = draw_example(random.Random(0))
    prompt = processor.apply_chat_template(user_message(question), add_generation_prompt=True, tokenize=False)
    if prompt.count(IMAGE_TOKEN) != 1:
        raise RuntimeError(f"the chat template rendered {prompt!r}")
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
    if placeholders != model.config.image_seq_length:
        raise RuntimeError(f"{placeholders} image placeholders, not {model.config.image_seq_length}")
    model.generate(**inputs, max_new_tokens=2, do_sample=False)


def save(model, processor, output: pathlib.Path) -> None:
    """Write float16 weights and the processor, replacing whatever `output` held."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as staging:
        staged = pathlib.Path(staging) / output.name
        model.to(torch.float16).save_pretrained(staged)
        model.to(torch.float32)
        processor.save_pretrained(staged)
        # The same JSON without the indentation that puts each of the 32000 merges on four lines: 1.0 MB
        # rather than 2.3, which keeps the directory under 25 MB.
        tokenizer_file = staged / "tokenizer.json"
        tokenizer_file.write_text(
            json.dumps(json.loads(tokenizer_file.read_text("utf-8")), ensure_ascii=False, separators=(",", ":")),
            "utf-8",
        )
        for path in staged.iterdir():
            path.chmod(0o644)  # safetensors writes its file for its owner alone
        if output.exists():
            shutil.rmtree(output)
        staged.rename(output)


def log_accuracy(title: str, accuracy: dict[str, float]) -> None:
    log.info("%s: %s", title, "  ".join(f"{kind} {value:.1%}" for kind, value in accuracy.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=9.0, help="wall-clock training budget, both stages")
    parser.add_argument("--tower-share", type=float, default=0.45, help="the part of it for stage 1")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the training pictures")
    parser.add_argument("--eval-seed", type=int, default=1_000_003, help="seeds the held-out pictures")
    parser.add_argument("--eval-examples", type=int, default=300)
    parser.add_argument("--tower-batch-size", type=int, default=64)
    parser.add_argument("--tower-lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4, help="stage 2: vision tower and projector")
    parser.add_argument("--lm-lr", type=float, default=5e-4, help="stage 2: language model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT_DIR)
    args = parser.parse_args()
    if args.eval_seed == args.seed:
        parser.error("the held-out pictures need a seed of their own")
    if "OMP_WAIT_POLICY" not in os.environ:
        # torch's OpenMP threads spin while they wait, which, on cores another process uses too, makes a step
        # three times as long. The variable is read as torch loads: start again with it set.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # not the torchvision fallback notice, nor progress bars, on every load
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    processor = build_processor()
    model = build_model(processor.tokenizer)
    log.info("%.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    check_processor(model, processor)

    started = time.monotonic()
    pretrain_tower(model, processor, rng, args)
    train(model, processor, rng, args)
    log.info("trained in %.0fs", time.monotonic() - started)
    log_accuracy("held-out, float32", evaluate(model, processor, args.eval_seed, args.eval_examples))

    save(model, processor, args.output)
    size = sum(f.stat().st_size for f in args.output.iterdir())
    log.info("saved to %s, %.2f MB", args.output, size / 1e6)
    saved = AutoModelForImageTextToText.from_pretrained(args.output, dtype=torch.float32).eval()
    saved_processor = AutoProcessor.from_pretrained(args.output)
    check_processor(saved, saved_processor)
    accuracy = evaluate(saved, saved_processor, args.eval_seed, args.eval_examples)
    log_accuracy("held-out, saved float16 loaded as float32", accuracy)
    if min(accuracy.values()) < 0.9:
        log.warning("below 90 %: train longer (--minutes)")


if __name__ == "__main__":
    main()
