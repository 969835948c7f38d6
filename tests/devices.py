"""The device the engine's tests run on: the CPU, or a GPU named by TOKENRELAY_TEST_DEVICE=cuda.

Without a GPU, a test run that asks for one skips the tests that would use
it rather than fail them.
"""

from __future__ import annotations

import os

import pytest
import torch

TEST_DEVICE = torch.device(os.environ.get("TOKENRELAY_TEST_DEVICE", "cpu"))

if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TOKENRELAY_TEST_DEVICE asks for CUDA, and none is available", allow_module_level=True)
