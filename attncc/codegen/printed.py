"""Generated code with what it uses: the helper functions it calls and the names it
reads, as the printer that wrote it reports them. A generator places each piece in
its templates and, from these reports alone, defines just the helpers the module calls
(attncc/codegen/helpers.py) and passes its per-tile functions just the names they read
(attncc/codegen/parameters.py): the module is rendered once and never read back.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ir


@dataclass(frozen=True)
class Code:
    text: str
    helpers: frozenset = frozenset()
    names: frozenset = frozenset()


class Printer(ir.Visitor):
    """A visitor that writes code and notes what it uses (`use`); `code(x)` prints x and
    says what that used, `capture(write)` the same for any writing of the printer's
    (while it also keeps noting it all for an enclosing print)."""

    def __init__(self):
        self.helpers: set = set()
        self.names: set = set()

    def use(self, helpers=(), names=()):
        self.helpers.update(helpers)
        self.names.update(names)

    def code(self, x) -> Code:
        return self.capture(lambda: self(x))

    def capture(self, write) -> Code:
        outer_helpers, outer_names = self.helpers, self.names
        self.helpers, self.names = set(), set()
        text = write()
        printed = Code(text, frozenset(self.helpers), frozenset(self.names))
        self.helpers, self.names = outer_helpers | self.helpers, outer_names | self.names
        return printed


def used(codes) -> tuple:
    """(helpers, names) all of `codes` use; None entries are skipped."""
    helpers, names = set(), set()
    for c in codes:
        if c is not None:
            helpers |= c.helpers
            names |= c.names
    return helpers, names
