"""Test setup: kernels run under the Triton interpreter without a GPU, and the suite
writes its generated modules and tuning files into a cache of its own.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at
collection, before any test module imports attncc's kernels.

The suite generates well over a hundred modules; they belong in a temporary directory,
not in the user's cache (~/.cache/attncc, or an ATTNCC_CACHE_DIR they set for their own
work), so the suite always sets ATTNCC_CACHE_DIR to one made here. pytest-xdist's
workers start after this file ran in the controller and inherit its environment, so
they share the controller's directory (a module one worker generated is reused by the
other), and the controller, which made it, removes it at exit.
"""
import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_SESSION_CACHE = "ATTNCC_TESTS_SESSION_CACHE"
if "PYTEST_XDIST_WORKER" in os.environ and os.environ.get(_SESSION_CACHE):
    _cache = os.environ[_SESSION_CACHE]
else:
    _cache = tempfile.mkdtemp(prefix="attncc-tests-")
    os.environ[_SESSION_CACHE] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ["ATTNCC_CACHE_DIR"] = _cache
