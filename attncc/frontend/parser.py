"""The .attn front end: text -> checked Variant, or a located SpecError.

The grammar lives in grammar/attn.lark; lark builds the parse tree and this module
turns it into IR one named node at a time, checking names and types as it goes so
that every error points at the text that caused it.
"""
from __future__ import annotations

import functools
import math
import unicodedata
from pathlib import Path

import lark
from lark import Token, Tree

from . import checker
from .. import ir
from ..analysis import float_decisions, ranges, reads
from ..operators import FUNCTIONS
from ..errors import SpecError, SpecWarning, did_you_mean, warn
from ..resources import grammar_path

# A variant is a few lines. The limits keep hostile input from taking long to parse
# (lark takes 50-120 us a token on a CI core, so 64 KB of `s,s,s...` would take
# seconds) or recursing past Python's stack in the passes.
MAX_SOURCE_BYTES = 1 << 16
MAX_TOKENS = 4096  # the largest example has 66
MAX_DEPTH = checker.MAX_DEPTH
MAX_INT = 2 ** 63 - 1  # integer literals must fit in 64 bits

# How lark's terminal names read in the language's own words.
TOKEN_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "COMP_OP": "a comparison",
    "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/', '//' or '%'", "LEARNABLE": "'learnable'",
    "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['",
    "RSQB": "']'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "SLASH": "'/'",
    "MINUS": "'-'", "$END": "the end of the file", "<END-OF-FILE>": "the end of the file",
}
KEYWORDS = checker.KEYWORDS


@functools.lru_cache(maxsize=1)
def _lark() -> lark.Lark:
    # Built once per process, with lark's on-disk cache of the LALR tables (0.4 s cold).
    return lark.Lark(grammar_path().read_text(), parser="lalr", propagate_positions=True,
                     maybe_placeholders=False, cache=True)


def parse_file(path) -> ir.Variant:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            # One byte past the limit is enough to refuse it (and /dev/zero never ends).
            data = f.read(MAX_SOURCE_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise SpecError(f"{path} is a directory, not a .attn file") from None
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_bytes(data, str(path))


def parse_bytes(data: bytes, path: str = "<spec>") -> ir.Variant:
    if len(data) > MAX_SOURCE_BYTES:
        raise SpecError(f"the file is larger than {MAX_SOURCE_BYTES} bytes, the limit for a "
                        "variant spec", path=path)
    try:
        text = data.decode("utf-8-sig")  # editors on Windows may write a byte-order mark
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line_end = data.find(b"\n", e.start)
        shown = data[line_start:None if line_end < 0 else line_end]
        column = len(data[line_start:e.start].decode("utf-8", "replace")) + 1
        raise SpecError(f"the file is not UTF-8 text (byte {e.start} cannot be decoded); "
                        "save it as UTF-8", path=path, line=line, column=column,
                        source_line=shown.decode("utf-8", "replace")) from None
    return parse(text, path)


def parse(text: str, path: str = "<spec>") -> ir.Variant:
    """Parse and check one variant written in the language."""
    if len(text) > MAX_SOURCE_BYTES:
        raise SpecError(f"the spec is {len(text)} characters long, more than the limit of "
                        f"{MAX_SOURCE_BYTES}", path=path)
    # Every line ending becomes \n (lark counts only \n, so a file with old Mac \r
    # endings would otherwise be one line), and positions and source lines agree.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if all(l.strip().startswith("#") or not l.strip() for l in lines):
        raise SpecError("the spec is empty: write `attention NAME { ... }`", path=path)
    _check_size(text, lines, path)
    try:
        tree = _lark().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise _syntax_error(e, text, lines, path) from None
    builder = _Builder(lines, path)
    deepest = _too_deep(tree)
    if deepest is not None:
        raise builder.fail(checker.too_deep_message(deepest, _tree_operator, _tree_first),
                           deepest[-1])
    return builder.variant(tree)


def _check_size(text, lines, path):
    """Refuse brackets nested past MAX_DEPTH, or more than MAX_TOKENS tokens, before
    lark spends long on the text or builds a tree that deep. One pass, no recursion."""
    depth, tokens, line, line_start, in_comment, in_word = 0, 0, 1, 0, False, False

    def refuse(message, i):
        return SpecError(message, path=path, line=line, column=i - line_start + 1,
                         source_line=lines[line - 1])

    for i, ch in enumerate(text):
        if ch == "\n":
            line, line_start, in_comment, in_word = line + 1, i + 1, False, False
            continue
        if in_comment:
            continue
        if ch == "#":
            in_comment, in_word = True, False
            continue
        word_char = ch.isalnum() or ch in "_."
        # A run of name, number or '.' characters is one token; every other visible
        # character counts as one (so `<=` counts two: an upper bound is enough).
        if not ch.isspace() and not (word_char and in_word):
            tokens += 1
            if tokens > MAX_TOKENS:
                raise refuse(f"the spec has more than {MAX_TOKENS} tokens, the limit for a "
                             "variant spec; a variant is a few declarations of short "
                             "expressions", i)
        in_word = word_char
        if ch in "([":
            depth += 1
            if depth > MAX_DEPTH:
                raise refuse(f"brackets are nested more than {MAX_DEPTH} levels deep", i)
        elif ch in ")]":
            depth = max(0, depth - 1)


def _too_deep(tree):
    """The path (root first) to the first expression node deeper than MAX_DEPTH, found
    without recursing, or None."""
    stack = [(tree, 0, None)]
    while stack:
        node, depth, path = stack.pop()
        path = (node, path)
        if depth > MAX_DEPTH:
            return checker._linked(path)
        stack.extend((c, depth + 1, path) for c in node.children if isinstance(c, Tree))
    return None


_CHAINS = {"or_": "or", "and_": "and", "not_": "not", "neg": "-"}


def _tree_operator(node):
    """What a parse-tree node chains with on the left (checker.too_deep_message)."""
    if node.data == "binop":
        return "+-" if str(node.children[1]) in checker.ADDITIVE else "*/"
    return _CHAINS.get(node.data)


def _tree_first(node):
    return node.children[0]


# ------------------------------------------------------------------------ syntax errors
def _syntax_error(e, text, lines, path) -> SpecError:
    line, col = getattr(e, "line", -1), getattr(e, "column", -1)
    if line is None or line < 1:  # end of input
        line = max(1, len(lines))
        col = len(lines[-1]) + 1 if lines else 1
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        return SpecError(_unexpected_character(ch), path=path, line=line, column=col,
                         source_line=src)
    token = _whole_name(text, getattr(e, "token", None))
    if token is not None and str(token) == "=" and text[token.end_pos:token.end_pos + 1] in "<>":
        written = "=" + text[token.end_pos]
        return SpecError(f"`{written}` is not an operator; did you mean `{written[::-1]}`?",
                         path=path, line=line, column=col, source_line=src, width=2)
    glued = _glued_word(text, token)
    if glued:
        # `1.2.3` or `12ab` lex as two tokens; name the whole word instead of its tail.
        word, start = glued
        col = start - (text.rfind("\n", 0, start) + 1) + 1
        return SpecError(f"malformed number '{word}'", path=path, line=line, column=col,
                         source_line=src, width=len(word))
    expected = sorted(getattr(e, "expected", None) or getattr(e, "accepts", None) or ())
    if token is None or token.type == "$END":
        what = "the file ended"
        width = 1
    else:
        what = f"unexpected {_describe_token(token)}"
        width = len(str(token))
    msg = what + _expectation(expected, token)
    return SpecError(msg, path=path, line=line, column=col, source_line=src, width=width)


def _unexpected_character(ch: str) -> str:
    hints = {"&": "write `and`", "|": "write `or`", "!": "write `not` (or `!=`)",
             ";": "declarations need no separator: start the next one on a new line",
             '"': "the language has no strings", "'": "the language has no strings"}
    if ch in hints:
        return f"unexpected character {ch!r}; {hints[ch]}"
    if not ch.isascii() and ch.isalnum():
        return f"unexpected character {ch!r}; names are ASCII letters, digits and '_'"
    if not ch.isprintable() or unicodedata.category(ch) == "Cf":
        # Invisible characters would print as nothing: name them.
        label = unicodedata.name(ch, "a control character")
        return f"unexpected invisible character U+{ord(ch):04X} ({label})"
    return f"unexpected character {ch!r}"


def _whole_name(text: str, token):
    """The token, or the whole name when it is a keyword that begins one: where no name
    may stand the lexer takes `in` out of `index` (or `inptu`, a misspelt `input`), and
    the error should quote what was written."""
    if token is None or not str(token).isalpha() or token.type == "NAME":
        return token
    end = token.end_pos
    while end < len(text) and (text[end].isalnum() or text[end] == "_"):
        end += 1
    if end == token.end_pos:
        return token
    return lark.Token.new_borrow_pos("NAME", text[token.start_pos:end], token)


def _glued_word(text: str, token):
    """(word, start) of `1.2.3` or `12ab` when `token` is the tail of a malformed number."""
    if token is None or token.type not in ("INT", "FLOAT", "NAME"):
        return None
    begin = token.start_pos
    while begin > 0 and (text[begin - 1].isalnum() or text[begin - 1] in "._"):
        begin -= 1
    word = text[begin:token.end_pos]
    if begin == token.start_pos or not (word[0].isdigit() or word[0] == "."):
        return None
    return word, begin


def _describe_token(tok: Token) -> str:
    value = str(tok)
    if tok.type == "NAME":
        return f"name '{value}'"
    if value in KEYWORDS or tok.type.isupper() and value.isalpha():
        return f"keyword '{value}'"
    if tok.type in ("INT", "FLOAT"):
        return f"number {value}"
    return f"'{value}'"


def _expectation(expected, token) -> str:
    words = set()
    for name in expected:
        if name in TOKEN_WORDS:
            words.add(TOKEN_WORDS[name])
        elif name.isupper() and name.lower() in KEYWORDS:
            words.add(f"'{name.lower()}'")
        else:
            words.add(f"'{name.lower()}'")
    decls = {f"'{d}'" for d in checker.DECL_NAMES} | {"'learnable'"}
    if decls & words and "'}'" in words:
        hint = "; expected a declaration (" + ", ".join(checker.DECL_NAMES) + ") or '}'"
        if token is not None and token.type == "NAME":
            # A misspelt declaration (`maks`), or a name after an incomplete one.
            hint += (did_you_mean(str(token), (*checker.DECL_NAMES, "learnable"))
                     or " (is the previous declaration complete?)")
        return hint
    if not words:
        return ""
    if "a number" in words:
        words.discard("an integer")  # an integer is a number
    if "a name" in words and "a number" in words and len(words) >= 4:
        return "; expected an expression"
    if token is not None and str(token) in KEYWORDS and "a name" in words:
        return f"; '{token}' is a keyword and cannot be used as a name"
    ordered = sorted(words)
    if len(ordered) == 1:
        return f"; expected {ordered[0]}"
    return "; expected " + ", ".join(ordered[:-1]) + " or " + ordered[-1]


# ------------------------------------------------------------------------ tree -> IR
class _Builder:
    """Builds the Variant from the parse tree; each method handles one named node."""

    def __init__(self, lines, path):
        self.lines = lines
        self.path = path
        self.params: dict = {}
        self.inputs: dict = {}
        self.scope: checker.Scope | None = None
        self.types: dict = {}  # id(IR node) -> its type, filled bottom-up
        self.trees: dict = {}  # id(IR node) -> the parse tree it came from, to locate errors

    def _locate(self, err: SpecError, where) -> SpecError:
        if isinstance(where, Token):
            line, col, width = where.line, where.column, len(str(where))
        else:
            meta = where.meta
            line, col = getattr(meta, "line", 1), getattr(meta, "column", 1)
            end = getattr(meta, "end_column", col + 1) if getattr(meta, "end_line", line) == line else None
            width = (end - col) if end else len(self.lines[line - 1]) - col + 1
        src = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return err.located(path=self.path, line=line, column=col, source_line=src, width=width)

    def fail(self, message: str, where) -> SpecError:
        return self._locate(SpecError(message), where)

    def integer(self, tok) -> int:
        """An INT token's value; huge literals are refused before int() sees them."""
        text = str(tok).lstrip("0") or "0"
        if len(text) > len(str(MAX_INT)) or int(text) > MAX_INT:
            shown = text if len(text) <= 30 else f"{text[:12]}...{text[-6:]} ({len(text)} digits)"
            raise self.fail(f"the integer {shown} is too large; integers must fit in 64 bits", tok)
        return int(text)

    # ---- the variant and its declarations
    def variant(self, tree: Tree) -> ir.Variant:
        name_tok, *decls = tree.children
        fields: dict = {}
        seen: dict = {}
        # Names may be used before the line that declares them: declare them first.
        ordered = sorted(decls, key=lambda d: d.data not in ("param_decl", "input_decl"))
        for d in ordered:
            kind = d.data.removesuffix("_decl")
            if kind not in ("param", "input"):
                if kind in seen:
                    first = seen[kind].meta.line
                    raise self.fail(f"`{kind}` is declared twice (first on line {first})", d)
                seen[kind] = d
            getattr(self, f"decl_{kind}")(d, fields)
        v = ir.Variant(name=str(name_tok), params=tuple(self.params.values()),
                       inputs=tuple(self.inputs.values()), **fields)
        self._check_ranges(v, seen)
        try:
            checker.check_structure(v)
        except SpecError as err:
            culprit = seen.get("block") or seen.get("layout") or seen.get("dropout") or tree
            if err.message.startswith("learnable input '"):  # its declaration
                name = err.message.split("'")[1]
                culprit = next((d for d in decls if d.data == "input_decl" and any(
                    isinstance(t, Token) and t.type == "NAME" and str(t) == name
                    for t in d.children)), tree)
            elif err.message.startswith("`sink`"):
                culprit = seen["sink"]
            elif "weight" in err.message or "normalize" in err.message:
                culprit = seen.get("weight") or seen.get("normalize") or tree
            elif "input" in err.message:
                culprit = next((d for d in decls if d.data == "input_decl"), tree)
            raise self._locate(err, culprit)
        self._warn_reads(v, seen)
        return v

    def _warn_reads(self, v: ir.Variant, seen: dict):
        """A SpecWarning, located at the read, for each fixed-size table read whose index
        can leave the table (attncc/analysis/reads.py), and at each decision a mask or
        layout takes on floats (attncc/analysis/float_decisions.py)."""
        found = [(decl, read.load, read) for decl, read in reads.escaping_reads(v)]
        found += [(decl, d.node, d) for decl, d in float_decisions.float_decisions(v)]
        for decl, node, finding in found:
            where = self.trees.get(id(node), seen[decl])
            located = self._locate(SpecError(finding.message(decl)), where)
            warn(SpecWarning(located.message, path=located.path, line=located.line,
                             column=located.column, source_line=located.source_line,
                             width=located.width))

    def _check_ranges(self, v: ir.Variant, seen: dict):
        """Divisions by zero and integers past 64 bits (attncc/analysis/ranges.py), located at the
        operator; once every declaration is known, since ranges depend on params and block."""
        params = {p.name: p.value for p in v.params}
        for kind in ("scale", "mask", "layout", "score", "sink", "weight"):
            e = getattr(v, kind)
            if e is None:
                continue
            where = lambda node, err: self._locate(err, self.trees.get(id(node), seen[kind]))
            try:
                ranges.check(e, params, self.inputs, v.block, on_error=where)
            except SpecError as err:
                raise self._locate(err, seen[kind])

    def decl_heads(self, d, fields):
        hq, hkv = (self.integer(t) for t in d.children)
        try:
            checker.check_heads(hq, hkv)
        except SpecError as err:
            raise self._locate(err, d)
        fields["heads"] = ir.Heads(hq, hkv)

    def decl_block(self, d, fields):
        (tok,) = d.children
        try:
            checker.check_block(self.integer(tok))
        except SpecError as err:
            raise self._locate(err, tok)
        fields["block"] = self.integer(tok)

    def decl_dropout(self, d, fields):
        (lit,) = d.children
        p = float(lit.children[0])
        if not math.isfinite(p):
            raise self.fail("dropout is out of range: the probability must be in [0, 1)", lit)
        try:
            checker.check_dropout(p)
        except SpecError as err:
            raise self._locate(err, lit)
        fields["dropout"] = p

    def decl_param(self, d, fields):
        name_tok, type_tok, *value = d.children
        name, type_name = str(name_tok), str(type_tok)
        self._check_new_name(name, name_tok)
        if type_name not in (ir.INT, ir.FLOAT, ir.BOOL):
            raise self.fail(f"unknown param type '{type_name}'; use int, float or bool", type_tok)
        if not value:
            raise self.fail(f"param '{name}' needs a value, as in `param {name}: {type_name} = "
                            f"{ {'int': '4', 'float': '1.0', 'bool': 'true'}[type_name] }`", d)
        self.scope = checker.Scope("param", self.params, self.inputs)
        expr = self.expr(value[0])
        if not isinstance(expr, ir.Const):
            raise self.fail(f"the value of param '{name}' must be a literal number or true/false",
                            value[0])
        if type_name == ir.FLOAT and expr.type == ir.INT:
            expr = ir.Const(float(expr.value), ir.FLOAT)
        if expr.type != type_name:
            raise self.fail(f"param '{name}' is declared {type_name} but its value is "
                            f"{checker.TYPE_WORDS[expr.type]}", value[0])
        self.params[name] = ir.ParamDecl(name, type_name, expr.value)

    def decl_input(self, d, fields):
        kids = list(d.children)
        learnable = isinstance(kids[0], Token) and kids[0].type == "LEARNABLE"
        if learnable:
            kids.pop(0)
        name_tok, dtype_tok, axes_tree = kids
        name = str(name_tok)
        self._check_new_name(name, name_tok)
        axes = tuple(self.integer(a.children[0]) if a.data == "axis_size" else str(a.children[0])
                     for a in axes_tree.children)
        inp = ir.InputDecl(name, str(dtype_tok), axes, learnable)
        try:
            checker.check_input(inp)
        except SpecError as err:
            bad = name_tok if name in checker.call_keywords() else (
                dtype_tok if str(dtype_tok) not in ir.DTYPES else (
                    name_tok if "learnable" in err.message else axes_tree))
            raise self._locate(err, bad)
        self.inputs[name] = inp

    def _check_new_name(self, name, tok):
        try:
            checker.check_name_free(name, set(self.params) | set(self.inputs))
        except SpecError as err:
            raise self._locate(err, tok)

    def _expr_decl(self, kind, d, fields):
        (body,) = d.children
        self.scope = checker.Scope(kind, self.params, self.inputs)
        e = self.expr(body)
        try:
            checker.check_depth(e)
            checker.check_declared_type(kind, self.types[id(e)])
        except SpecError as err:
            raise self._locate(err, body)
        fields[kind] = e

    def decl_mask(self, d, fields):
        self._expr_decl("mask", d, fields)

    def decl_layout(self, d, fields):
        self._expr_decl("layout", d, fields)

    def decl_score(self, d, fields):
        self._expr_decl("score", d, fields)

    def decl_sink(self, d, fields):
        self._expr_decl("sink", d, fields)

    def decl_normalize(self, d, fields):
        (tok,) = d.children
        try:
            checker.check_normalize(str(tok))
        except SpecError as err:
            raise self._locate(err, tok)
        fields["normalize"] = str(tok)

    def decl_weight(self, d, fields):
        self._expr_decl("weight", d, fields)

    def decl_scale(self, d, fields):
        self._expr_decl("scale", d, fields)

    # ---- expressions: build a node, type it with the shared rules, locate any error
    def expr(self, t):
        node = getattr(self, f"x_{t.data}", None) if isinstance(t, Tree) else None
        if node is None:
            raise self.fail(f"internal: no rule for {getattr(t, 'data', t)!r}", t)
        e, kids = node(t)
        self.trees[id(e)] = t
        try:
            if isinstance(e, ir.Var):
                self.scope.resolve(e.name)
            self.types[id(e)] = checker.type_of(e, [self.types[id(k)] for k in kids], self.scope)
        except SpecError as err:
            raise self._locate(err, t)
        return e

    def x_int_lit(self, t):
        return ir.Const(self.integer(t.children[0]), ir.INT), ()

    def x_float_lit(self, t):
        value = float(t.children[0])
        if not math.isfinite(value):
            text = str(t.children[0])
            shown = text if len(text) <= 30 else f"{text[:12]}...{text[-6:]}"
            raise self.fail(f"the number {shown} is too large", t)
        return ir.Const(value, ir.FLOAT), ()

    def x_true_lit(self, t):
        return ir.Const(True, ir.BOOL), ()

    def x_false_lit(self, t):
        return ir.Const(False, ir.BOOL), ()

    def x_name(self, t):
        try:
            node = self.scope.resolve(str(t.children[0]))
        except SpecError as err:
            raise self._locate(err, t)
        return node, ()

    def x_neg(self, t):
        inner = self.expr(t.children[0])
        # A minus sign on a literal is part of the literal, as in Python: -1.5 is
        # Const(-1.5), so both front ends build the same IR.
        if isinstance(inner, ir.Const) and inner.type != ir.BOOL:
            return ir.Const(-inner.value, inner.type), ()
        return ir.Neg(inner), (inner,)

    def x_binop(self, t):
        lhs, op, rhs = t.children
        a, b = self.expr(lhs), self.expr(rhs)
        return ir.BinOp(str(op), a, b), (a, b)

    def x_compare(self, t):
        ops = [str(o) for o in t.children[1::2]]
        if len(ops) > checker.MAX_DEPTH:
            # `a < b < c ...` becomes a chain of `and`: say what was written.
            raise self.fail(f"this comparison chain is longer than {checker.MAX_DEPTH} "
                            f"comparisons ({len(ops)}); a variant's expressions are a few "
                            "operators long", t.children[1 + 2 * checker.MAX_DEPTH])
        operands = [self.expr(c) for c in t.children[0::2]]
        result = None
        for i, op in enumerate(ops):
            cmp = ir.Cmp(op, operands[i], operands[i + 1])
            try:
                self.types[id(cmp)] = checker.type_of(
                    cmp, [self.types[id(operands[i])], self.types[id(operands[i + 1])]], self.scope)
            except SpecError as err:
                raise self._locate(err, t.children[2 * i + 1])
            if result is None:
                result = cmp
            else:
                result = ir.And(result, cmp)
                self.types[id(result)] = ir.BOOL
        # Each link was typed above (errors point at its operator); expr() types the
        # outermost node again from its two already-typed children.
        return result, (result.lhs, result.rhs)

    def x_and_(self, t):
        a, b = self.expr(t.children[0]), self.expr(t.children[1])
        return ir.And(a, b), (a, b)

    def x_or_(self, t):
        a, b = self.expr(t.children[0]), self.expr(t.children[1])
        return ir.Or(a, b), (a, b)

    def x_not_(self, t):
        a = self.expr(t.children[0])
        return ir.Not(a), (a,)

    def x_call(self, t):
        fn_tok, *arg_trees = t.children
        fn = str(fn_tok)
        entry = FUNCTIONS.get(fn)
        if entry is None:
            if fn in self.inputs:
                raise self.fail(f"'{fn}' is a tensor; index it with [ ], not ( )", fn_tok)
            if fn in ("not", "and", "or"):
                # `x == not (c)`: after a comparison `not` is read as a call, as in Python,
                # which refuses it too.
                raise self.fail(f"`{fn}` cannot follow a comparison operator: parenthesize "
                                f"the condition, as in `x == ({fn} c)`", fn_tok)
            raise self.fail(f"unknown function '{fn}': the functions are {', '.join(FUNCTIONS)}"
                            f"{did_you_mean(fn, FUNCTIONS)}", fn_tok)
        problem = entry.arity_problem(len(arg_trees))
        if problem:
            raise self.fail(problem, t)
        args = tuple(self.expr(a) for a in arg_trees)
        return entry.make(*args), args

    def x_member(self, t):
        item_tree, name_tok, *index_trees = t.children
        name = str(name_tok)
        if name not in self.inputs:
            raise self.fail(f"unknown tensor '{name}'{did_you_mean(name, self.inputs)}"
                            + ("" if self.inputs else "; declare it with `input`"), name_tok)
        item = self.expr(item_tree)
        idx = tuple(self.expr(i) for i in index_trees)
        return ir.Member(item, name, idx), (item, *idx)

    def x_load(self, t):
        name_tok, *index_trees = t.children
        name = str(name_tok)
        if name not in self.inputs:
            if name in self.params or name in ir.INDEX_VARS:
                raise self.fail(f"'{name}' is not a tensor and cannot be indexed", name_tok)
            raise self.fail(f"unknown tensor '{name}'{did_you_mean(name, self.inputs)}"
                            + ("" if self.inputs else "; declare it with `input`"), name_tok)
        idx = tuple(self.expr(i) for i in index_trees)
        return ir.Load(name, idx), idx
