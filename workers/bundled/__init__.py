"""The bundled models: their checkpoints, their places and names, and (in training/) how they were made.

The checkpoints sit beside this module: model/ (with its LoRA adapters in
model/adapters/), draft_model/ and vision_model/. This module also names the
dtypes a worker can load and its model code, all known without torch: the
command line needs them for its options and defaults, and a gateway process
never loads a model, so it must not pay for torch and transformers to start.
training/ holds the scripts that made the checkpoints; nothing that serves
imports them.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent / "model"
BUNDLED_MODEL_NAME = "tokenrelay-tiny"
# Two LoRA adapters of the bundled model (training/adapters.py): one answers in upper case, one in Python.
BUNDLED_ADAPTERS = {name: BUNDLED_MODEL / "adapters" / name for name in ("shout", "code")}
# The bundled model distilled into 2 layers (training/draft.py): a draft for --speculative-model.
BUNDLED_DRAFT_MODEL = Path(__file__).resolve().parent / "draft_model"
BUNDLED_VISION_MODEL = Path(__file__).resolve().parent / "vision_model"  # training/vision_model.py
BUNDLED_VISION_MODEL_NAME = "tokenrelay-tiny-vision"
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
MODEL_IMPLS = ("auto", "native", "transformers")  # workers/engine/models/: the engine's own code, or transformers'
