"""The call records: the options of one call that cross the torch.library boundary
(attncc/runtime/ops.py), each field declaring its op-schema type once.

The ops' schemas, their fake implementations, the autograd formula's saved call and
the real implementations' unpacking all follow from a record's fields, so a new call
option is one new field (and its use in the kernels), not an edit of every spelling of
the op's arguments. `CallOptions` is the attention call's (forward and backward ops);
kernel.decode's op takes a `DecodeOptions` (attncc/runtime/decoding.py). Every field
has a default: code that runs the
generated modules without going through the ops (a context-parallel piece pair, in
attncc/distributed/ring.py) names only the options it sets.
"""
from __future__ import annotations

import dataclasses

import torch

from ..arguments import check_seed

NO_TABLES = 0  # the `tables` id of a call given no kept tables


def option(schema_type: str, default):
    """A field of a call record: its type in a torch.library schema (SymInt, Tensor?, int,
    int[], bool ...) and its value where a call does not set it."""
    return dataclasses.field(default=default, metadata={"schema": schema_type})


class CallRecord:
    """What a call record spells at the op boundary. Subclasses are made with
    @call_record, which lists their fields in FIELDS (a plain tuple, which torch.compile
    traces: dataclasses.fields is not traceable)."""
    FIELDS: tuple = ()

    @classmethod
    def schema_arguments(cls) -> str:
        """The record's part of an op schema's argument list, in field order."""
        return ", ".join(f"{f.metadata['schema']} {f.name}" for f in dataclasses.fields(cls))

    def op_arguments(self) -> tuple:
        """The field values in schema order: what an op call passes after its tensors. An
        op implementation gets them back as `*options` and rebuilds the record with
        `type(record)(*options)`."""
        return tuple([getattr(self, name) for name in self.FIELDS])


def call_record(cls):
    """Make `cls` (a CallRecord subclass) a frozen dataclass whose every field says its
    schema type (`option`)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    for f in fields:
        if "schema" not in f.metadata:  # attncc's bug: the ops could not pass it
            raise TypeError(f"call record {cls.__name__} field '{f.name}' has no schema type: "
                            "declare it with option(schema_type, default)")
    cls.FIELDS = tuple(f.name for f in fields)
    return cls


@call_record
class CallOptions(CallRecord):
    """The options of one attention call, as its forward and backward ops take them.

    Integers are SymInts, so that under torch.compile they stay dynamic (not baked into
    the graph). A seed the call draws itself is a one-element CPU int64 tensor from
    torch's generator, so that a compiled graph draws a fresh one on every run. Kept
    TileTables cross as an int id into runtime/ops.py's registry: they are not tensors
    to hand over (the generated module builds them lazily per tile size, and the tuner
    picks the tile size inside the op)."""
    q_offset: int = option("SymInt", 0)  # the position of the first query
    k_offset: int = option("SymInt", 0)  # and of the first key
    seed: int = option("SymInt", 0)  # dropout_seed as given; 0 where drawn or no dropout
    drawn_seed: torch.Tensor | None = option("Tensor?", None)  # the seed the call drew, if any
    tables: int = option("int", NO_TABLES)  # the kept TileTables' id (runtime/ops.py)
    # False: the backward may sum dQ with atomic adds in no fixed order (the Gluon fused
    # backward), so its last bits may differ between runs (runtime/scheduling.py).
    deterministic: bool = option("bool", True)

    @classmethod
    def received(cls, arguments: tuple) -> "CallOptions":
        """The record an op implementation receives (its `*options`), with the checks of
        values a traced call could not read: a given seed (attncc/arguments.py's
        check_seed passes a SymInt through unchecked)."""
        call = cls(*arguments)
        if call.drawn_seed is None:
            check_seed(call.seed)
        return call

    def launch_arguments(self, table_store) -> dict:
        """The keyword arguments of the generated modules' launches (forward, dQ, dK/dV,
        one-launch backward; the Gluon ones alike) for this call: each field under its
        own name, but for `deterministic` (the backward's schedule reads it, no launch
        takes it) and the two that cross the op boundary as stand-ins. A drawn seed
        is read into `seed` (a CPU tensor: reading it syncs nothing), and the kept
        tables' id gives way to `table_store`, where the launch finds its tile tables
        (kept tables' store, a store of the caller's own, or None for the module's cache
        of recent calls)."""
        arguments = {name: getattr(self, name) for name in self.FIELDS}
        drawn_seed = arguments.pop("drawn_seed")
        del arguments["deterministic"]  # the schedule's choice, not a launch's argument
        if drawn_seed is not None:
            arguments["seed"] = int(drawn_seed)
        arguments["tables"] = table_store
        return arguments
