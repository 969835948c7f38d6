"""The scripts that trained the bundled checkpoints, on the CPU, from what ships with Python.

model.py trains the text model (and its tokenizer), adapters.py its two LoRA
adapters with PEFT, draft.py distils it into a 2-layer draft, and
vision_model.py trains the vision-language model on pictures it draws. Each
runs as `python -m workers.bundled.training.<name>` (docs/models.md).

They are tools, not the runtime: they may use anything, and nothing that
serves may import them (pyproject.toml's import contracts hold it). Tests
may, for the pictures the vision model was trained on.
"""
