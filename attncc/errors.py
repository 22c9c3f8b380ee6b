"""Errors a user can cause, each in the language's own words and, for specs, located."""
from __future__ import annotations

import difflib
import os
import sys
import warnings

# Hostile input can make a message or a source line megabytes long; show a window of it.
MAX_MESSAGE = 600  # attncc's own longest hints (the decorator's list of functions) fit
MAX_SHOWN_LINE = 100


class AttnccError(Exception):
    """Base class of every error attncc raises on purpose."""


class _Located:
    """A message and, when known, where in a spec it is (file, line, column, the source
    line and the width of the text to underline): what SpecError and SpecWarning share."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 column: int | None = None, source_line: str | None = None, width: int = 1):
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.source_line = source_line
        self.width = max(1, width)


class SpecError(_Located, AttnccError):
    """A malformed or meaningless variant: a sentence, and where it is when we know.

    Printed as `file:line:col: error: sentence`, then the source line and a caret under
    the offending text — the form compilers use, so editors can jump to it.
    """

    def located(self, *, path, line, column, source_line, width=1) -> "SpecError":
        """This error with a position attached (the first position given wins)."""
        if self.line is None:
            self.path, self.line, self.column = path, line, column
            self.source_line, self.width = source_line, max(1, width)
        return self

    def __str__(self) -> str:
        return _located_text(self, "error")


class SpecWarning(_Located, UserWarning):
    """A variant that compiles but likely does not mean what it says (a read of a
    fixed-size table that can leave it). A Python warning, so it can be filtered or made
    an error: `warnings.simplefilter("error", attncc.SpecWarning)`. Printed located, as
    SpecError is, with `warning:` instead of `error:`."""

    def __str__(self) -> str:
        return _located_text(self, "warning")


def warn(warning: Warning):
    """Issue `warning` attributed to the first caller outside attncc (the user's parse,
    compile or decorator line), as warnings.warn's stacklevel would if it were fixed."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2  # stacklevel 2 is the frame that called warn()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)


def _located_text(e, severity: str) -> str:
    """`file:line:col: severity: sentence`, the source line, and a caret under the text."""
    message = e.message
    if len(message) > MAX_MESSAGE:
        message = f"{message[:MAX_MESSAGE - 100]} ... {message[-80:]}"
    if e.line is None:
        where = f"{e.path}: " if e.path else ""
        return f"{where}{severity}: {message}"
    head = f"{e.path or '<spec>'}:{e.line}:{e.column}: {severity}: {message}"
    if e.source_line is None:
        return head
    # Control characters (a NUL, a terminal escape) print as U+FFFD, one column each.
    text = "".join(c if c.isprintable() else "\ufffd"
                   for c in e.source_line.rstrip("\n").expandtabs(1))
    width = min(e.width, max(1, len(text) - e.column + 1))
    column = e.column
    if len(text) > MAX_SHOWN_LINE:
        # Show the part of the line around the caret, marked as cut with '...'.
        start = max(0, column - 1 - MAX_SHOWN_LINE // 2)
        end = start + MAX_SHOWN_LINE
        shown = ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")
        column = column - start + (3 if start else 0)
        width = min(width, len(shown) - column + 1)
        text = shown
    return f"{head}\n    {text}\n    {' ' * (column - 1)}{'^' * width}"


class CallError(AttnccError, ValueError):
    """A kernel called with arguments it cannot take: names the argument, the given and the expected."""


class BackendError(AttnccError, ValueError):
    """A backend asked for by name (`backend="gluon"`) cannot run this variant or call:
    names what it cannot take, and the way out."""


class CacheError(AttnccError, OSError):
    """attncc's cache directory cannot be written: names the directory and the fix."""


class SettingError(AttnccError, ValueError):
    """An ATTNCC_* environment variable holds a value attncc does not know: names the
    variable, the value and the values it takes."""


class NoGPUError(AttnccError):
    """Something that needs a CUDA GPU was asked for on a machine without one."""


class KernelCompileError(AttnccError, RuntimeError):
    """Triton's compiler failed on a generated kernel at one tile config (ptxas crashed):
    names the variant, the kernel, the head dim and dtype, the config, and the way out."""


class KernelFaultError(AttnccError, RuntimeError):
    """A generated kernel faulted on the GPU (an illegal memory access or its kin), which
    leaves the CUDA context unusable: names where it surfaced and the ways around it."""


# CUDA errors after which the context is unusable: every later launch and copy fails as
# well (cudaErrorIllegalAddress and its kin), so nothing after one can be trusted.
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal instruction", "misaligned address",
                       "unspecified launch failure", "hardware stack error",
                       "invalid program counter", "device-side assert", "launch timed out")


def is_kernel_fault(e: BaseException) -> bool:
    """Whether `e` reports a CUDA error that leaves the context unusable."""
    text = str(e).lower()
    return any(s in text for s in _STICKY_CUDA_ERRORS)


def did_you_mean(name: str, candidates) -> str:
    """A '; did you mean 'x'?' suffix when a close candidate exists, else ''."""
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
