"""The contract between generated modules and the rest of attncc: every name the runtime
and the tools use on a generated module, with what it is. A generated module is
standalone (it imports only the standard library, torch and triton; what both backends'
modules need on the host, codegen/templates/host_args.jinja, is rendered into each), so
this list is the only place that says what it owes; tests/test_interface.py checks
rendered modules against it, and that attncc uses no other name of theirs.
"""
from __future__ import annotations

# The tile tables' fields, per side ("row": query tiles' key tiles, for the forward and
# dQ; "col": key tiles' query tiles, for dK/dV): lists of full and partial tiles, their
# counts, the strides of their batch, head and row axes (tables are broadcast over
# the batch and heads they do not depend on), and the order the side's programs run in
# (the grid's program i runs the side's unit `order[i]`, longest first: loops.jinja's
# tile_order). They are the kernels' parameters of those
# names (backends/portable/codegen.py's common_params) and the keys of tile_tables()'s
# dict, which the generated module builds in this order.
def table_fields(side: str) -> list:
    return [f"{side}_full_count", f"{side}_full_list", f"{side}_part_count", f"{side}_part_list",
            f"{side}_count_sb", f"{side}_count_sh", f"{side}_list_sb", f"{side}_list_sh",
            f"{side}_list_sm", f"{side}_order"]


TABLE_FIELDS = table_fields("row") + table_fields("col")

# The portable module (backends/portable/templates/attention.py.jinja, backends/portable/codegen.py).
PORTABLE = {
    # constants
    "USES_TABLES": "True when tiles come from tile tables (runtime/ops.py, settings.backward_directions)",
    "TABLE_INPUTS": "the inputs the tile tables read (runtime/kernel.py: TileTables' promise)",
    "COMMON_PARAMS": "the kernels' run-time arguments after the tensors and strides, in order",
    "TABLE_FIELDS": "tile_tables()'s keys, TABLE_FIELDS above",
    "DECODE_STRATEGY": "a sentence on how kernel.decode skips keys (tools/decode_bench.py)",
    # forward and backward (runtime/ops.py, distributed/ring.py)
    "forward": "forward(q, k, v, inputs, *, q_offset, k_offset, seed, config, tables, launcher) "
               "-> (out, lse) (launcher: runtime/call_plans.py, as backward_dq's and _dkdv's)",
    "backward_delta": "backward_delta(out, dout, *, lse=None, dlse=None, launcher=None) -> "
                      "delta (minus dlse)",
    "new_delta": "new_delta(q) -> the delta tensor backward_dq(..., out=) fills",
    "backward_dq": "backward_dq(q, k, v, lse, delta, dout, inputs, *, ..., out=None, dlse=None) "
                   "-> (dq, dinputs)",
    "backward_dkdv": "backward_dkdv(q, k, v, lse, delta, dout, inputs, *, ...) -> (dk, dv), "
                     "and dinputs where the variant reads learnable inputs by key alone",
    # tile tables (runtime/kernel.py: kept tables and densities)
    "tile_tables": "tile_tables(B, H, len_q, len_k, q_offset, k_offset, dim, inputs, block_m, "
                   "block_n, device) -> {field: tensor}",
    # decoding (runtime/decoding.py)
    "decode": "decode(q, k_cache, v_cache, lens, inputs, *, ...) -> (out, lse)",
    "decode_plan": "decode_plan(q, k_cache, v_cache, lens, inputs, *, ..., launcher) -> "
                   "run(q, k_cache, v_cache, lens, inputs, k_new, v_new, block_table)",
    "decode_append_kv": "writes k_new, v_new into the cache in place",
    "decode_reach_tiles": "the key tiles a decode step's rows can reach",
    "v_is_k": "v_is_k(k_cache, v_cache) -> whether v is a view of k's first columns (MLA: "
              "the values come from the K tiles, a decode plan of its own)",
}
# Present only when USES_TABLES: dK/dV and dQ in one launch.
PORTABLE_WITH_TABLES = {
    "backward_one_launch": "backward_one_launch(q, k, v, lse, delta, dout, inputs, *, ..., "
                           "launcher=None) -> (dq, dk, dv, dinputs)",
}
# Present only where the variant has learnable inputs (runtime/kernel.py: deterministic=).
PORTABLE_WITH_LEARNABLE = {
    "atomic_reads": "atomic_reads(B, H, len_q, len_k, inputs) -> [the learnable inputs whose "
                    "gradients this call would add with fp32 atomics]",
}
# The Gluon module (backends/gluon/templates/attention_gluon.py.jinja,
# backends/gluon/codegen.py): it builds its tile tables and arguments itself, from the
# shared host template (codegen/templates/host_args.jinja).
GLUON = {
    "forward": "forward(q, k, v, inputs, *, q_offset, k_offset, seed, config, "
               "tables, launcher) -> (out, lse)",
    "backward_dq": "backward_dq(q, k, v, lse, delta, dout, inputs, *, ..., "
                   "out=None, dlse=None) -> (dq, dinputs) (runtime/kernel.py: backward_role)",
    "backward_dkdv": "backward_dkdv(q, k, v, lse, delta, dout, inputs, *, ...) "
                     "-> (dk, dv), and dinputs where the variant reads learnable inputs by "
                     "key alone",
}
# Present only where the Gluon fused backward takes the variant (softmax, no learnable
# inputs: backends/gluon/__init__.py's fused_variant_unsupported).
GLUON_FUSED = {
    "backward_fused": "backward_fused(q, k, v, lse, delta, dout, inputs, *, ...) "
                      "-> (dq, dk, dv) (runtime/scheduling.py: deterministic=False)",
}


def missing(module, uses_tables: bool, backend: str = "triton", learnable: bool = False,
            fused: bool = False) -> list:
    """The names of the contract a generated module lacks (empty when it keeps it);
    `fused`: a Gluon module with the fused backward."""
    names = {**GLUON, **(GLUON_FUSED if fused else {})} if backend == "gluon" else {
        **PORTABLE, **(PORTABLE_WITH_TABLES if uses_tables else {}),
        **(PORTABLE_WITH_LEARNABLE if learnable else {})}
    return [name for name in names if not hasattr(module, name)]
