"""Names an input may not take, and the names a call or a spec misspells.

Inputs are keyword arguments of every call that takes them (**inputs): an input named
like another keyword of one of those calls could never be passed. attncc/calls.py derives
those keywords from the calls' signatures; this file finds the calls independently (every
function in attncc with **inputs) so a keyword added later cannot be missed.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import attncc
from attncc.errors import SpecError
from attncc.reserved import call_keywords


def _functions_taking_inputs():
    """Every function and method in attncc's modules with a **inputs parameter."""
    found = {}
    for info in pkgutil.walk_packages(attncc.__path__, "attncc."):
        if info.name.startswith("attncc.tools") or info.name.endswith("__main__"):
            continue  # command-line tools: they pass inputs they built themselves
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [obj] if inspect.isfunction(obj) else (
                [m for _, m in inspect.getmembers(obj, inspect.isfunction)]
                if inspect.isclass(obj) else [])
            for fn in members:
                params = inspect.signature(fn).parameters.values()
                if any(p.kind == p.VAR_KEYWORD and p.name == "inputs" for p in params):
                    found[f"{module.__name__}.{fn.__qualname__}"] = fn
    return found


def test_every_call_that_takes_inputs_has_its_keywords_reserved():
    found = _functions_taking_inputs()
    assert len(found) >= 8, sorted(found)  # the finder itself works
    reserved = call_keywords()
    for where, fn in found.items():
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                assert p.name in reserved, f"{where} takes {p.name}=, which an input may be named"


@pytest.mark.parametrize("name, call", [
    ("cu_seqlens_q", "a varlen kernel's call"), ("cu_seqlens_k", "a varlen kernel's call"),
    ("max_seqlen_q", "a varlen kernel's call"), ("max_seqlen_k", "a varlen kernel's call"),
    ("group", "context_parallel_attention"), ("scheme", "context_parallel_attention"),
    ("return_lse", "the kernel call"), ("k_cache", "kernel.decode"), ("v", "a varlen kernel's call"),
])
def test_an_input_named_like_a_call_keyword_is_refused(name, call):
    with pytest.raises(SpecError, match=rf"an input cannot be named '{name}': .*{call}.* {name}="):
        attncc.parse(f"attention a {{ input {name}: f32[h]\n score s + {name}[h] }}")


@pytest.mark.parametrize("name", ["self", "kernel", "variant"])
def test_inputs_named_like_positional_parameters_can_be_passed(name):
    """q, k, v and the object before them are positional-only: these names are free."""
    spec = f"attention a {{ input {name}: f32[h]\n mask q >= k\n score s + {name}[h] * (k - q) }}"
    kernel = attncc.compile(spec)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, n, 16, generator=gen) for n in (19, 23, 23))
    slopes = torch.rand(3, generator=gen)
    out = kernel(q, k, v, **{name: slopes})
    want = attncc.reference(kernel.variant, q.double(), k.double(), v.double(),
                            **{name: slopes.double()})
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    # The other calls that take inputs accept the name too.
    torch.testing.assert_close(kernel.decode(q[:, :, -1:], k, v, cache_seqlens=23,
                                             **{name: slopes}).double(),
                               attncc.decode_reference(kernel.variant, q[:, :, -1:].double(),
                                                       k.double(), v.double(), cache_seqlens=23,
                                                       **{name: slopes.double()}),
                               atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ did you mean
ALIBI = "attention a { input slopes: f32[h]\n mask q >= k\n score s + slopes[h] * (k - q) }"


@pytest.mark.parametrize("typo, meant", [("retrun_lse", "return_lse"), ("q_ofset", "q_offset"),
                                          ("dropout_sed", "dropout_seed"), ("slops", "slopes"),
                                          ("k_cach", "k_cache")])
def test_a_misspelt_call_keyword_or_input_gets_a_suggestion(typo, meant):
    kernel = attncc.compile(ALIBI)
    q = torch.randn(1, 2, 5, 16)
    inputs = {} if meant == "slopes" else {"slopes": torch.rand(2)}
    with pytest.raises(attncc.CallError, match=rf"unexpected input '{typo}'.*; did you mean '{meant}'\?"):
        kernel(q, q, q, **inputs, **{typo: 1})
    with pytest.raises(attncc.CallError, match=rf"did you mean '{meant}'\?"):
        attncc.reference(kernel.variant, q, q, q, **inputs, **{typo: 1})


def test_several_misspelt_keywords_each_get_their_suggestion():
    kernel = attncc.compile(ALIBI)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(attncc.CallError) as err:
        kernel(q, q, q, slopes=torch.rand(2), retrun_lse=True, q_ofset=1, zzz=2)
    msg = str(err.value)
    assert "for 'retrun_lse', did you mean 'return_lse'?" in msg
    assert "for 'q_ofset', did you mean 'q_offset'?" in msg
    assert "'zzz', did you mean" not in msg  # nothing close: no guess


def test_an_unknown_name_with_nothing_close_gets_no_suggestion():
    kernel = attncc.compile(ALIBI)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(attncc.CallError) as err:
        kernel(q, q, q, slopes=torch.rand(2), xyzzy=1)
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("typo, meant", [("maks", "mask"), ("scroe", "score"), ("inptu", "input"),
                                          ("learnabel", "learnable"), ("hedas", "heads"),
                                          ("layot", "layout"), ("dropuot", "dropout")])
def test_a_misspelt_declaration_gets_a_suggestion(typo, meant):
    with pytest.raises(SpecError, match=rf"unexpected name '{typo}'.*; did you mean '{meant}'\?"):
        attncc.parse(f"attention a {{ mask q >= k\n {typo} q >= k }}")


def test_a_name_after_an_incomplete_declaration_still_gets_that_hint():
    with pytest.raises(SpecError, match=r"'window'.*is the previous declaration complete\?"):
        attncc.parse("attention a { mask q >= k window }")


def test_a_misspelt_member_of_a_variant_class_gets_a_suggestion():
    class Causal:
        def maks(q, k):
            return q >= k
    with pytest.raises(SpecError, match=r"has \['maks'\].*; did you mean 'mask'\?"):
        attncc.variant(Causal)


def test_a_misspelt_compile_option_gets_a_suggestion():
    with pytest.raises(TypeError, match=r"'confg'.*; did you mean 'config'\?"):
        attncc.compile("attention c { mask q >= k }", confg={})
