"""The variants of examples/*.attn written with the Python decorator instead.

Each one builds the same `attncc.Variant` as the .attn file of the same name (the tests
check that they are equal), so either form compiles to the same kernel:

    import attncc
    from examples.python_variants import EXAMPLES
    kernel = attncc.compile(EXAMPLES["sliding_window"])

Tracing rules, in short: `&`, `|`, `~` stand for and, or, not, with parentheses around
each comparison; attncc.minimum/maximum/tanh/... for the language's functions; a
function's parameters name the index variables, params and inputs it reads. A plain
function is the mask; a class groups mask, score, layout and scale.
"""
import attncc
from attncc import maximum, minimum, sqrt, tanh


@attncc.variant
class full:
    """No mask: every query sees every key."""


@attncc.variant
def causal(q, k):
    return q >= k


@attncc.variant
def causal_bottom_right(q, k, len_q, len_k):
    # The last query lines up with the last key.
    return q + len_k - len_q >= k


@attncc.variant(heads=(32, 8))
def gqa_causal(q, k):
    return q >= k


@attncc.variant(params={"window": 1024})
def sliding_window(q, k, window):
    return (q >= k) & (q - k < window)


@attncc.variant(params={"prefix": 256})
def prefix_lm(q, k, prefix):
    return (q >= k) | (k < prefix)


@attncc.variant(inputs={"doc_q": "i32[q]", "doc_k": "i32[k]"})
def document(q, k, doc_q, doc_k):
    return (doc_q[q] == doc_k[k]) & (q >= k)


@attncc.variant(params={"window": 2048, "dilation": 4})
def dilated_window(q, k, window, dilation):
    return (q >= k) & (q - k < window) & ((q - k) % dilation == 0)


@attncc.variant(params={"chunk": 8192})
def chunked_local(q, k, chunk):
    return (q // chunk == k // chunk) & (q >= k)


@attncc.variant(params={"window": 256, "n_global": 16})
def longformer(q, k, window, n_global):
    return (abs(q - k) <= window) | (q < n_global) | (k < n_global)


@attncc.variant(inputs={"slopes": "f32[h]"})
class alibi:
    def mask(q, k):
        return q >= k

    def score(s, h, q, k, slopes):
        return s + slopes[h] * (k - q)


@attncc.variant(params={"cap": 50.0})
class softcap:
    def scale():
        return 1.0 / sqrt(144.0)

    def mask(q, k):
        return q >= k

    def score(s, cap):
        return cap * tanh(s / cap)


@attncc.variant(inputs={"bias": "f32[h, 511]"}, learnable=["bias"])
class relative_bias:
    def score(s, h, q, k, bias):
        return s + bias[h, minimum(maximum(q - k, -255), 255) + 255]


@attncc.variant(inputs={"random_blocks": "bool[qb, kb]"}, block=128)
class bigbird:
    def layout(qb, kb, random_blocks):
        return (abs(qb - kb) <= 1) | (qb == 0) | (kb == 0) | random_blocks[qb, kb]


@attncc.variant(params={"seed": 0}, block=128)
class bigbird_seeded:
    def layout(h, qb, kb, seed):
        return ((abs(qb - kb) <= 1) | (qb == 0) | (kb == 0)
                | attncc.chance(0.0234375, seed, h, qb, kb))  # the language's chance(...)


@attncc.variant(dropout=0.1)
def dropout(q, k):
    return q >= k


# ------------------------------------------------------------ block-sparse research
@attncc.variant(params={"stride": 4}, block=128)
class sparse_strided:
    def mask(q, k):
        return q >= k

    def layout(qb, kb, stride):
        return (kb <= qb) & ((qb - kb < stride) | ((qb - kb) % stride == 0))


@attncc.variant(params={"local": 4, "summary": 1}, block=128)
class sparse_fixed:
    def mask(q, k):
        return q >= k

    def layout(qb, kb, local, summary):
        return (qb // local == kb // local) | (kb % local >= local - summary)


@attncc.variant(params={"stride": 4}, block=64)
class sparse_heads:
    def mask(q, k):
        return q >= k

    def layout(h, qb, kb, stride):
        return (kb <= qb) & (((h % 2 == 0) & (qb - kb < stride))
                             | ((h % 2 == 1) & ((qb - kb) % stride == 0)))


@attncc.variant(params={"segment": 4, "dilation": 4}, block=64)
class dilated_blocks:
    def mask(q, k):
        return q >= k

    def layout(qb, kb, segment, dilation):
        return ((qb // segment == kb // segment)
                | ((qb // (segment * dilation) == kb // (segment * dilation))
                   & ((qb - kb) % dilation == 0)))


@attncc.variant(inputs={"blocks": "bool[h, qb, kb]"}, block=64)
class vertical_slash:
    def mask(q, k):
        return q >= k

    def layout(h, qb, kb, blocks):
        return blocks[h, qb, kb]


@attncc.variant(inputs={"selected": "bool[b, h, qb, kb]"}, block=64)
class nsa_selected:
    def mask(q, k):
        return q >= k

    def layout(b, h, qb, kb, selected):
        return selected[b, h, qb, kb]


@attncc.variant(inputs={"top": "i32[b, h, qb, 8]"}, block=64)
class nsa_topk:
    def mask(q, k):
        return q >= k

    def layout(b, h, qb, kb, top):
        return attncc.isin(kb, top[b, h, qb])  # the language's `kb in top[b, h, qb]`


@attncc.variant(params={"window": 128}, inputs={"sinks": "f32[h]"}, learnable=["sinks"])
class gpt_oss_sinks:
    def mask(q, k, window):
        return (q >= k) & (q - k < window)

    def sink(h, sinks):
        return sinks[h]


@attncc.variant(params={"bias": -9.0}, normalize="none")
class sigmoid_attention:
    def mask(q, k):
        return q >= k

    def weight(s, bias):
        return attncc.sigmoid(s + bias)


@attncc.variant(normalize="none")
class relu_attention:
    def weight(s, len_k):
        return attncc.maximum(s, 0.0) / len_k


# Keyed by the stem of the .attn file that declares the same variant.
EXAMPLES = {v.name: v for v in (
    full, causal, causal_bottom_right, gqa_causal, sliding_window, prefix_lm, document,
    dilated_window, chunked_local, longformer, alibi, softcap, relative_bias, bigbird,
    bigbird_seeded, dropout, sparse_strided, sparse_fixed, sparse_heads, dilated_blocks,
    vertical_slash, nsa_selected, nsa_topk, gpt_oss_sinks, sigmoid_attention, relu_attention,
)}
