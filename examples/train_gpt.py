"""Train a small GPT whose attention no stock kernel runs in one call, under torch.compile.

The attention is document-causal, windowed and softcapped: a token attends to earlier
tokens of its own document, at most `window` back, and scores pass through
`cap * tanh(s / cap)` (Gemma 2's softcap). FlashAttention has windows and softcap but
no document mask; SDPA takes a dense mask but cannot change scores; FlexAttention can
run it, from a block mask built per batch. attncc compiles it from four lines:

    attention doc_window_softcap {
        input doc: i32[b, q]
        mask doc[b, q] == doc[b, k] and q >= k and q - k < 16
        score 20.0 * tanh(s / 20.0)
    }

The corpus is made here: documents of random length, each an arithmetic progression
over the vocabulary after a BOS token, packed into rows of `seq` tokens; a row's
document ids are the running count of BOS tokens. The whole model (embeddings, blocks,
loss) is compiled with torch.compile(fullgraph=True); the attncc kernel is one operator
in its graph.

    python examples/train_gpt.py                  # CPU: a few steps under the Triton
                                                  # interpreter, losses against the
                                                  # same model with attncc.reference
    python examples/train_gpt.py --bench          # GPU: tokens/s for attncc,
                                                  # FlexAttention (its Triton kernels and
                                                  # FlashAttention-4's) and SDPA; JSON to $OUT

On the GPU, --bench first checks one attention call of each backend against the
float64 reference (the tests' tolerance rule), then trains the same model from the same
initial weights with each backend (bf16 autocast, AdamW) and times the steps after a
warm-up that compiles and tunes. SDPA runs the mask only: it cannot softcap scores, so
its row is the same model without softcap, and its loss differs. The `flex_flash` row is
FlexAttention with kernel_options={"BACKEND": "FLASH"}: the same mask_mod and score_mod
on FlashAttention-4's CuTe kernels, which must be installed (flash-attn-4); without them
the row says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc.semantics.tolerance import max_abs_error, within_tolerance

BOS = 0
BACKENDS = ("attncc", "reference", "flex", "flex_flash", "sdpa")
BENCHED = ("attncc", "flex", "flex_flash", "sdpa")  # --bench's rows, in this order


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    layers: int = 2
    heads: int = 2
    dim: int = 32  # head dim = dim // heads; the kernels take 16 to 256
    seq: int = 48
    batch: int = 2
    window: int = 16
    softcap: float = 20.0


TINY = Config()  # the CPU run and the test
GPU = Config(vocab=128, layers=6, heads=12, dim=768, seq=4096, batch=8, window=1024, softcap=30.0)


def variant_spec(window: int, softcap: float | None) -> str:
    """The attention variant (softcap=None: the mask alone, what SDPA can run)."""
    score = f"\n    score {softcap!r} * tanh(s / {softcap!r})" if softcap else ""
    return (f"attention doc_window{'_softcap' if softcap else ''} {{\n"
            f"    input doc: i32[b, q]\n"
            f"    mask doc[b, q] == doc[b, k] and q >= k and q - k < {window}{score}\n}}")


# ------------------------------------------------------------------ the corpus
def make_corpus(n_tokens: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Documents of 8 to 40 tokens: BOS, then start, start + step, ... over tokens
    1..vocab-1 (step 1 to 3), so that a model can learn to continue one."""
    docs, total = [], 0
    while total < n_tokens:
        length = int(torch.randint(8, 41, (1,), generator=gen))
        start = int(torch.randint(0, vocab - 1, (1,), generator=gen))
        step = int(torch.randint(1, 4, (1,), generator=gen))
        body = (start + step * torch.arange(length - 1)) % (vocab - 1) + 1
        docs.append(torch.cat([torch.tensor([BOS]), body]))
        total += length
    return torch.cat(docs)[:n_tokens]


def get_batch(corpus: torch.Tensor, config: Config, gen: torch.Generator, device):
    """Rows of seq tokens at random offsets: inputs, next-token targets, document ids."""
    starts = torch.randint(0, len(corpus) - config.seq - 1, (config.batch,), generator=gen)
    rows = torch.stack([corpus[s:s + config.seq + 1] for s in starts.tolist()])
    x, y = rows[:, :-1], rows[:, 1:]
    doc = (x == BOS).cumsum(1).to(torch.int32)  # [B, L]; a row may start mid-document
    return x.to(device), y.to(device), doc.to(device)


# ------------------------------------------------------------------ attention backends
class AttnccAttention:
    """The compiled variant: one operator in the compiled model's graph."""
    name = "attncc"

    def __init__(self, config: Config):
        self.kernel = attncc.compile(variant_spec(config.window, config.softcap))

    def prepare(self, doc):  # per batch, outside the compiled model
        return doc

    def __call__(self, q, k, v, doc):
        return self.kernel(q, k, v, doc=doc)


class ReferenceAttention(AttnccAttention):
    """attncc.reference: the variant evaluated densely in PyTorch (the truth)."""
    name = "reference"

    def __init__(self, config: Config):
        self.variant = attncc.parse(variant_spec(config.window, config.softcap))

    def __call__(self, q, k, v, doc):
        return attncc.reference(self.variant, q, k, v, doc=doc)


class FlexAttention:
    """FlexAttention: the same mask as a mask_mod (block mask rebuilt per batch, as its
    documentation does for document masks) and the softcap as a score_mod."""
    name = "flex"

    def __init__(self, config: Config):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # Compiled on a GPU, also where --bench checks one call outside the model: eager
        # flex_attention runs its unfused math (for either backend), not the kernels timed.
        self.config = config
        self.flex_attention = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
        self.doc = None  # one buffer, copied into per batch: mask_mod stays one function
        window, cap = config.window, config.softcap

        def mask_mod(b, h, q_idx, kv_idx):
            doc = self.doc
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        self.mask_mod, self.score_mod = mask_mod, score_mod
        compiled = "_compile" in inspect.signature(create_block_mask).parameters
        self.create_block_mask = lambda *a, **kw: create_block_mask(
            *a, **kw, **({"_compile": True} if compiled and torch.cuda.is_available() else {}))

    def prepare(self, doc):
        if self.doc is None or self.doc.shape != doc.shape:
            self.doc = doc.clone()
        self.doc.copy_(doc)
        B, L = doc.shape
        return self.create_block_mask(self.mask_mod, B, None, L, L, device=doc.device)

    def __call__(self, q, k, v, block_mask):
        return self.flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask)


class FlexFlashAttention(FlexAttention):
    """FlexAttention's FLASH backend: the same mask_mod, score_mod and block mask, run by
    FlashAttention-4's CuTe kernels (a CUDA GPU and the flash-attn-4 package)."""
    name = "flex_flash"

    def __init__(self, config: Config):
        if importlib.util.find_spec("flash_attn") is None:
            raise RuntimeError("FlexAttention's FLASH backend runs FlashAttention-4's kernels: "
                               "install flash-attn-4 (flash_attn.cute) to time this row")
        super().__init__(config)

    def __call__(self, q, k, v, block_mask):
        return self.flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                                   kernel_options={"BACKEND": "FLASH"})


class SdpaAttention:
    """scaled_dot_product_attention with the dense boolean mask [B, 1, L, L] of the same
    variant. It cannot softcap scores: this is the model without softcap."""
    name = "sdpa"

    def __init__(self, config: Config):
        self.window = config.window

    def prepare(self, doc):
        i = torch.arange(doc.shape[1], device=doc.device)
        causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
        return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [B, 1, L, L]

    def __call__(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def make_attention(backend: str, config: Config):
    return {"attncc": AttnccAttention, "reference": ReferenceAttention, "flex": FlexAttention,
            "flex_flash": FlexFlashAttention, "sdpa": SdpaAttention}[backend](config)


# ------------------------------------------------------------------ the model
class Block(nn.Module):
    def __init__(self, config: Config, attention):
        super().__init__()
        self.heads, self.attention = config.heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.proj = nn.Linear(config.dim, config.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.GELU(),
                                 nn.Linear(4 * config.dim, config.dim))

    def forward(self, x, mask):
        B, L, C = x.shape
        # [B, L, 3, H, D] -> 3 x [B, H, L, D], views in sequence-major layout (no copy)
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v, mask).transpose(1, 2).reshape(B, L, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: Config, attention):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.dim)
        for p in (self.tokens.weight, self.positions.weight):
            nn.init.normal_(p, std=0.02)  # GPT-2's: the first loss is about log(vocab)

    def forward(self, x, targets, mask):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tokens(x) + self.positions(pos)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.ln(h) @ self.tokens.weight.t()  # tied embeddings
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ------------------------------------------------------------------ training
def train(backend: str, config: Config = TINY, *, steps: int = 3, device="cpu", seed: int = 0,
          compile_backend: str | None = "inductor", lr: float = 3e-3, autocast: bool = False,
          warmup: int = 0) -> dict:
    """Train for `steps` steps from weights and batches fixed by `seed`; the losses, and
    the time of the steps after the first `warmup` (which compile and tune).
    compile_backend=None runs the model eagerly."""
    torch.manual_seed(seed)
    attention = make_attention(backend, config)
    model = GPT(config, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    step_model = model if compile_backend is None else torch.compile(
        model, backend=compile_backend, fullgraph=True)
    gen = torch.Generator().manual_seed(seed + 1)
    corpus = make_corpus(max(4 * config.seq, 20 * config.batch * config.seq), config.vocab, gen)
    batches = [get_batch(corpus, config, gen, device) for _ in range(steps)]
    losses, start = [], None
    for i, (x, y, doc) in enumerate(batches):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        mask = attention.prepare(doc)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = step_model(x, y, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    seconds = time.perf_counter() - start if start is not None else math.nan
    timed = steps - warmup
    return {"backend": backend, "losses": [float(l) for l in losses], "timed_steps": timed,
            "step_ms": 1e3 * seconds / timed if timed else math.nan,
            "tokens_per_s": timed * config.batch * config.seq / seconds if timed else math.nan}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ GPU benchmark
def check_attention(config: Config, device, dtype=torch.bfloat16, L: int = 1000,
                    backends=BENCHED) -> list:
    """One attention call of each backend against the float64 reference (the tests'
    rule: error within twice the same-dtype eager error plus slack). SDPA is held to
    the variant without softcap, which is what it runs. A backend that cannot run here
    (FLASH without FlashAttention-4) gives a row with its error."""
    gen = torch.Generator().manual_seed(7)
    B, H, D = 2, 4, config.dim // config.heads
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(device) for _ in range(3))
    doc = torch.sort(torch.randint(0, 6, (B, L), generator=gen), dim=1).values.to(torch.int32).to(device)
    rows = []
    for backend in backends:
        variant = attncc.parse(variant_spec(config.window, None if backend == "sdpa" else config.softcap))
        try:
            attention = make_attention(backend, config)
            got = attention(q.to(dtype), k.to(dtype), v.to(dtype), attention.prepare(doc))
        except Exception as e:  # report it and go on with the other backends
            rows.append({"backend": backend, "len": L, "ok": False,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        ref = attncc.reference(variant, q.double(), k.double(), v.double(), doc=doc)
        eager = attncc.reference(variant, q.to(dtype), k.to(dtype), v.to(dtype), doc=doc)
        err, eager_err = max_abs_error(got, ref), max_abs_error(eager, ref)
        rows.append({"backend": backend, "len": L, "max_abs_error": err, "eager_error": eager_err,
                     "ok": within_tolerance(err, eager_err, dtype, ref)})
    return rows


def bench(config: Config, steps: int, warmup: int, out_dir: str | None) -> dict:
    device = "cuda"
    checks = check_attention(config, device)
    runs = []
    for backend in BENCHED:
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            run = train(backend, config, steps=warmup + steps, warmup=warmup, device=device,
                        autocast=True, lr=1e-3)
        except Exception as e:  # report it and go on with the other backends
            run = {"backend": backend, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        run["wall_s"] = time.perf_counter() - t0
        run["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        run["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        run["softcap"] = backend != "sdpa"
        runs.append(run)
    result = {"config": dataclasses.asdict(config), "steps": steps, "warmup": warmup,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "checks": checks, "runs": runs}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train_gpt.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(format_table(result))
    return result


def _check_cell(row: dict) -> str:
    if "error" in row:
        return f"{row['backend']} did not run ({row['error']})"
    return (f"{row['backend']} {'ok' if row['ok'] else 'FAIL'} ({row['max_abs_error']:.2g} "
            f"vs eager {row['eager_error']:.2g})")


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}: "
             f"{c['layers']} layers, dim {c['dim']}, {c['heads']} heads, batch {c['batch']} x "
             f"{c['seq']} tokens, window {c['window']}, softcap {c['softcap']}, bf16 autocast",
             f"attention vs float64 reference (one call, L={result['checks'][0]['len']}): "
             + ", ".join(_check_cell(r) for r in result["checks"]),
             f"{'backend':10s} {'tokens/s':>10s} {'step ms':>9s} {'peak GiB':>9s} "
             f"{'warm-up s':>9s} {'last loss':>9s}  note"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['backend']:10s} failed: {r['error']}")
            continue
        note = "" if r["softcap"] else "mask only: SDPA cannot softcap"
        if r["graph_breaks"]:
            note += f" {r['graph_breaks']} graph breaks"
        warm = r["wall_s"] - r["step_ms"] * r["timed_steps"] / 1e3
        lines.append(f"{r['backend']:10s} {r['tokens_per_s']:10.0f} {r['step_ms']:9.1f} "
                     f"{r['peak_gib']:9.2f} {warm:9.1f} {r['losses'][-1]:9.4f}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", action="store_true",
                    help="GPU: tokens/s of attncc, flex, flex_flash (FlashAttention-4), SDPA")
    ap.add_argument("--steps", type=int, default=None, help="training steps (3; --bench: 20)")
    ap.add_argument("--warmup", type=int, default=3, help="--bench: untimed steps first")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (--bench: 4096)")
    ap.add_argument("--batch", type=int, default=None)
    args = ap.parse_args(argv)
    for name in ("steps", "seq", "batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not args.bench and args.warmup != 3:
        ap.error("--warmup sets --bench's untimed steps; without --bench it does nothing")
    if args.bench:
        if not torch.cuda.is_available():
            print("train_gpt.py --bench needs a CUDA GPU", file=sys.stderr)
            return 2
        config = dataclasses.replace(GPU, seq=args.seq or GPU.seq, batch=args.batch or GPU.batch)
        bench(config, args.steps or 20, args.warmup, os.environ.get("OUT"))
        return 0
    config = dataclasses.replace(TINY, seq=args.seq or TINY.seq, batch=args.batch or TINY.batch)
    steps = args.steps or 3
    # On the CPU the kernels run under the Triton interpreter, behind the operator;
    # aot_eager compiles the model without generating C++ for the rest of it.
    got = train("attncc", config, steps=steps, compile_backend="aot_eager")
    want = train("reference", config, steps=steps, compile_backend=None)
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        print(f"step {i}: loss {a:.6f} (attncc, compiled)  {b:.6f} (attncc.reference)  "
              f"difference {abs(a - b):.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
