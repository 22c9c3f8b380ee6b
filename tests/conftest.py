"""Test setup: without a GPU, kernels run under the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at
collection, before any test module imports attncc's kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
