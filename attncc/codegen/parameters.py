"""Which parameters the per-tile device functions take: of the names they could read,
those their code reads.

The step functions (`_fwd_step`, `_dq_step`, `_dkdv_step`, `_decode_allowed`,
`_decode_step`) and the tile-run functions that call them (`_fwd_tiles`, ...) take their
row and context arguments from name lists the templates spell once (`fwd_row`,
`fwd_ctx`, ... in backends/portable/templates/macros.jinja and
backends/portable/templates/decode.py.jinja), so that every signature and every call
site agree. Those lists hold every name a variant's mask, score, layout or dropout
might read: the query tile's index and bounds, the head, the offsets, the seed. A
variant reads a few of them: those its code reads, as the printers report
(attncc/codegen/printed.py), and those the templates' own code in the functions reads
under the variant's flags (READS). A list keeps the names some function taking it
reads. Triton inlines these functions, so the unread parameters would cost nothing at
run time; leaving them out is for the reader of the generated module.
"""
from __future__ import annotations

# The families of per-tile functions that take each template list (a step function
# and the tile-run function that calls it), and hand it on to each other.
USERS = {
    "fwd_row": ("fwd",),
    "fwd_ctx": ("fwd", "dq"),
    "dq_row": ("dq",),
    "dkdv_ctx": ("dkdv",),
    "dkdv_col": ("dkdv",),
    "dec_row": ("decode",),
    "dec_ctx": ("decode",),
}

# What each family's template code reads of the lists: always, and under each flag of
# the variant that adds code ("score": a score is computed, "no score": the scale is
# folded into qk_scale; "dropout"; "decode layout": the layout over decode rows;
# "normalised": rows are divided by a normaliser, read back as the LSE, with its delta
# term: softmax and `normalize sum`, not `normalize none`).
READS = {
    "fwd": {
        "always": {"q", "q_tail", "m_valid", "K", "V", "stride_kn", "stride_kd", "stride_vn",
                   "stride_vd", "k_offset", "len_k"},
        "dropout": {"seed", "pid_bh", "offs_m", "q_offset"},
        "score": {"sm_scale"}, "no score": {"qk_scale"},
    },
    "dq": {
        "always": {"q", "q_tail", "do", "m_valid", "K", "V", "stride_kn", "stride_kd", "stride_vn",
                   "stride_vd", "k_offset", "len_k"},
        "normalised": {"lse2", "delta"},
        "dropout": {"seed", "pid_bh", "offs_m", "q_offset"},
        "score": {"sm_scale"}, "no score": {"qk_scale"},
    },
    "dkdv": {
        "always": {"k", "k_tail", "v", "k_valid", "Q", "DO", "stride_qm", "stride_qd", "stride_dom",
                   "stride_dod", "len_q", "q_offset"},
        "normalised": {"LSE", "DELTA"},
        "dropout": {"seed", "pid_bh", "offs_n", "k_offset"},
        "score": {"sm_scale"}, "no score": {"qk_scale"},
    },
    "decode": {
        "always": {"q", "q_tail", "row_ok", "K", "V", "BT", "stride_kb", "stride_kn", "stride_kd",
                   "stride_vb", "stride_vn", "stride_vd", "stride_btn", "num_pages", "len_k"},
        "decode layout": {"q_pos"},
        "score": {"sm_scale"}, "no score": {"qk_scale"},
    },
}


class Unread:
    """The names of a list that no function taking it reads: all but `read`."""

    def __init__(self, read):
        self.read = frozenset(read)

    def __contains__(self, name) -> bool:
        return name not in self.read


def unread(flags, code_reads: dict) -> dict:
    """For each template list, its names no function taking it reads. `flags`: the
    variant's (READS' keys); `code_reads`: {family: names the variant's code there reads}."""
    reads = {family: set().union(*(names for flag, names in kinds.items()
                                   if flag == "always" or flag in flags))
             | set(code_reads.get(family, ()))
             for family, kinds in READS.items()}
    return {listed: Unread(set().union(*(reads[f] for f in families)))
            for listed, families in USERS.items()}


def without(names: str, dropped) -> str:
    """The jinja filter: a ", "-separated name list less the `dropped` names."""
    return ", ".join(n for n in (s.strip() for s in names.split(",")) if n and n not in dropped)
