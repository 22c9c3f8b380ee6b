"""The call records (attncc/runtime/call_options.py): what crosses the ops' boundary.

The ops' schemas, fake implementations and autograd formula are made from a record's
fields. These tests pin the schemas to the hand-written ones they replaced (a compiled
graph cached on disk calls the ops by their argument lists), and show that a record
with a field more is carried through an op call, its fake under torch.compile and its
autograd formula, with nothing else edited: a new call option is one field.
"""
from __future__ import annotations

import uuid

import pytest
import torch
import torch._dynamo

from attncc.runtime import ops
from attncc.runtime.call_options import CallOptions, CallRecord, call_record, option
from attncc.runtime.decoding import CONFIG_KEYS, DecodeOptions


def test_the_schemas_are_the_hand_written_ones():
    """Today's fields give, word for word, the schemas attncc spelt by hand before, and
    the one field added since (deterministic, last)."""
    assert ops.FORWARD_SCHEMA == (
        "(int kernel, Tensor q, Tensor k, Tensor v, Tensor[] inputs, SymInt q_offset, "
        "SymInt k_offset, SymInt seed, Tensor? drawn_seed, int tables, bool deterministic) "
        "-> (Tensor, Tensor)")
    assert ops.BACKWARD_SCHEMA == (
        "(int kernel, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
        "Tensor? dlse, Tensor[] inputs, SymInt q_offset, SymInt k_offset, SymInt seed, "
        "Tensor? drawn_seed, int tables, bool deterministic) "
        "-> (Tensor, Tensor, Tensor, Tensor[])")
    assert ops.DECODE_SCHEMA == (
        "(int kernel, Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
        "Tensor? k_new, Tensor? v_new, Tensor? block_table, Tensor[] inputs, int num_splits, "
        "int[] config, bool rows_before_start) -> (Tensor, Tensor)")


def test_op_arguments_rebuild_the_record():
    call = CallOptions(q_offset=3, k_offset=5, seed=7, tables=9)
    assert call.op_arguments() == (3, 5, 7, None, 9, True)
    assert CallOptions(*call.op_arguments()) == call
    decode = DecodeOptions.of(None, dict(zip(CONFIG_KEYS, (32, 4, 2, 3))), True)
    assert DecodeOptions(*decode.op_arguments()) == decode
    assert decode.run_arguments() == dict(
        num_splits=None, config=dict(BLOCK_N=32, num_warps=4, num_stages=2, num_splits=3),
        rows_before_start=True)
    assert DecodeOptions.of(4, None, False).run_arguments() == dict(
        num_splits=4, config=None, rows_before_start=False)


def test_launch_arguments_read_the_seed_the_call_drew():
    given = CallOptions(q_offset=2, k_offset=1, seed=11)
    assert given.launch_arguments(None) == dict(q_offset=2, k_offset=1, seed=11, tables=None)
    store = {}
    drawn = CallOptions(drawn_seed=torch.tensor([123]))
    arguments = drawn.launch_arguments(store)
    assert arguments["seed"] == 123 and arguments["tables"] is store


def test_an_op_implementation_checks_the_seed_a_trace_could_not():
    with pytest.raises(Exception, match=r"dropout_seed=4294967296 is out of range"):
        CallOptions.received((0, 0, 2 ** 32, None, 0))
    # A drawn seed is not the caller's: nothing to check.
    assert CallOptions.received((0, 0, 0, torch.tensor([5]), 0)).drawn_seed.item() == 5


def test_a_field_without_a_schema_type_is_refused():
    with pytest.raises(TypeError, match=r"field 'flag' has no schema type.*option\("):
        @call_record
        class Broken(CallRecord):
            flag: bool = False


# ------------------------------------------------------------ a new option, one field
@call_record
class WithMore(CallOptions):
    """CallOptions with two options more, of the kinds the next ones may have: a flag and
    an optional tensor (attention sinks)."""
    extra_flag: bool = option("bool", False)
    sinks: torch.Tensor | None = option("Tensor?", None)


class _Stand:
    """What the ops' kernel id points to (the registry is weak)."""


@pytest.fixture(scope="module")
def more_ops():
    """Ops defined for WithMore, with implementations that record what they receive: a
    forward that doubles q, a backward that doubles dout into dq and gives the learnable
    input the sum of the sinks."""
    received = []

    def forward_impl(kernel, q, k, v, inputs, *options):
        received.append(("forward", WithMore.received(options)))
        return q * 2, q.new_zeros(q.shape[:3], dtype=torch.float32)

    def backward_impl(kernel, q, k, v, out, lse, dout, dlse, inputs, *options):
        call = WithMore.received(options)
        received.append(("backward", call))
        return (dout * 2, torch.zeros_like(k), torch.zeros_like(v),
                [torch.full_like(inputs[0], call.sinks.sum().item())])

    stand = _Stand()
    name = f"call_options_test_{uuid.uuid4().hex[:8]}"
    operators = ops._define(name, [0], WithMore, forward_impl, backward_impl)
    yield operators, ops.register_kernel(stand), received
    del stand


def _assert_carried(got: WithMore, want: WithMore):
    for name in WithMore.FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, name


def test_a_new_field_reaches_the_schemas_and_the_launches():
    assert WithMore.FIELDS[-2:] == ("extra_flag", "sinks")
    assert ops.forward_schema(WithMore).endswith(
        "bool deterministic, bool extra_flag, Tensor? sinks) -> (Tensor, Tensor)")
    assert ("bool deterministic, bool extra_flag, Tensor? sinks) "
            "-> (Tensor, Tensor, Tensor, Tensor[])") in ops.backward_schema(WithMore)
    sinks = torch.ones(2)
    # deterministic is the backward schedule's, not a launch argument.
    assert WithMore(seed=3, extra_flag=True, sinks=sinks).launch_arguments(None) == dict(
        q_offset=0, k_offset=0, seed=3, tables=None, extra_flag=True, sinks=sinks)


@pytest.mark.parametrize("traced", [False, True])
def test_a_new_field_crosses_the_ops_and_their_autograd(more_ops, traced):
    """Eager (the autograd kernel) and traced by torch.compile (the fake implementation,
    then AOTAutograd's backward): both implementations receive the record's every field,
    and the backward's gradient flows to the learnable input."""
    operators, kernel_id, received = more_ops
    received.clear()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen, requires_grad=True) for _ in range(3))
    slope = torch.rand(2, generator=gen, requires_grad=True)
    call = WithMore(q_offset=3, k_offset=1, seed=7, deterministic=False, extra_flag=True,
                    sinks=torch.tensor([0.5, 1.5]))

    def attend(q, k, v, slope, call):
        op = operators.forward if torch.compiler.is_compiling() else operators.apply
        return op(kernel_id, q, k, v, [slope], *call.op_arguments())

    if traced:
        torch._dynamo.reset()
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out, lse = attend(q, k, v, slope, call)
    assert torch.equal(out, q * 2) and lse.shape == (1, 2, 5)
    out.sum().backward()
    assert torch.equal(q.grad, torch.full_like(q, 2.0))
    assert torch.equal(slope.grad, torch.full_like(slope, 2.0))  # the sinks' sum
    assert [where for where, _ in received] == ["forward", "backward"]
    for _, got in received:
        _assert_carried(got, call)
    torch._dynamo.reset()
