"""The `attncc` command: show, compile, check and bench a variant spec.

Exit codes: 0 success, 1 a check out of tolerance, 2 a bad spec or bad usage (a located
message on stderr, never a traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from ..errors import AttnccError, SpecError, SpecWarning

# The longest sequence `check` and `bench` take: the float64 reference holds len_q x len_k
# scores per head (at 65536, 32 GiB a head), and the kernels' positions are int32.
MAX_COMMAND_LENGTH = 65536


def _lengths(text: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
    if max(values) > MAX_COMMAND_LENGTH:
        raise argparse.ArgumentTypeError(f"lengths must be at most {MAX_COMMAND_LENGTH}, got "
                                         f"{max(values)}")
    return values


def _heads(text: str):
    try:
        hq, _, hkv = text.partition("/")
        return int(hq), int(hkv or hq)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HQ or HQ/HKV, got {text!r}")


SPEC_HELP = ("the variant: a .attn file, spec text in quotes, or FILE.py:NAME for a variant "
             "made with @attncc.variant in a Python file (FILE.py alone when it defines one)")
HEADS_HELP = "HQ, or HQ/HKV query and key/value heads for GQA, such as 8/2"


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__
    p = argparse.ArgumentParser(prog="attncc", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"attncc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    show = sub.add_parser("show", help="print the variant's IR in the language")
    show.add_argument("spec", help=SPEC_HELP)
    show.add_argument("--plot", metavar="PNG", help="draw the mask and its tile classes (needs "
                      "attncc[plot])")
    show.add_argument("--len", type=int, default=None, help="sequence length for --plot "
                      "(default 512)")
    show.add_argument("--len-k", type=int, default=None, help="key length for --plot (default --len)")
    show.add_argument("--tile", type=int, default=None, help="tile size for --plot (default 64)")

    comp = sub.add_parser("compile", help="write the generated Triton module")
    comp.add_argument("spec", help=SPEC_HELP)
    comp.add_argument("-o", "--out", default=".", help="directory to write NAME.py into "
                      "(created if missing; default: the current directory)")
    comp.add_argument("--len", type=int, default=None, help="report the fraction of tiles "
                      "visited at this length (at most 8192)")
    from .. import backends
    comp.add_argument("--backend", default=backends.portable().name,
                      choices=["auto", backends.portable().name,
                               *(b.name for b in backends.preferred())],
                      help="another backend than the portable one (or auto: each that can run "
                      "the variant) also writes its module, DIR/<name>_<backend>.py")

    check = sub.add_parser("check", help="compare the kernels with the reference on random inputs")
    check.add_argument("spec", help=SPEC_HELP)
    check.add_argument("--len", type=_lengths, default=None, help="square sequence lengths "
                       "(default: small awkward ones, some with len_q != len_k)")
    check.add_argument("--len-q", type=_lengths, default=None, help="query lengths, paired in "
                       "order with --len-k (one value pairs with each of the other's)")
    check.add_argument("--len-k", type=_lengths, default=None, help="key lengths (see --len-q)")
    check.add_argument("--inputs", metavar="FILE.pt", default=None, help="the variant's inputs: "
                       "a dict {name: tensor} saved with torch.save, used at every length "
                       "(default: invented from --seed; the output says how)")
    check.add_argument("--dim", type=int, default=None, help="head dim (default: 64 on a GPU, "
                       "32 under the interpreter)")
    check.add_argument("--dim-v", type=int, default=None, help="v's head dim, where it differs "
                       "from q's and k's (default: --dim)")
    check.add_argument("--heads", type=_heads, default=None, help=HEADS_HELP + "; default: the "
                       "declared heads, else 3")
    check.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                       help="dtype of q, k, v (default: bfloat16 on a GPU, float32 under the "
                       "interpreter, which cannot run bfloat16)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (each "
                       "length adds its index)")

    bench = sub.add_parser("bench", help="time forward and backward against SDPA and FlexAttention (GPU)")
    bench.add_argument("spec", help=SPEC_HELP)
    bench.add_argument("--len", type=_lengths, default=[4096, 16384], help="sequence lengths; "
                       "each runs with batch 16384 // len (with --decode: cache lengths)")
    bench.add_argument("--dim", type=int, default=128, help="head dim")
    bench.add_argument("--heads", type=_heads, default=None, help=HEADS_HELP + "; default: the "
                       "declared heads, else 16 (32/8 with --decode)")
    bench.add_argument("--json", metavar="FILE", help="write every timing to FILE as JSON")
    bench.add_argument("--plot", metavar="PNG", help="draw TFLOP/s per backend (needs "
                       "attncc[plot])")
    bench.add_argument("--decode", action="store_true",
                       help="time a decode step (kernel.decode) on caches of --len keys instead, "
                            "against FlexAttention's decoding kernel and SDPA")
    bench.add_argument("--batch", type=int, default=1,
                       help="--decode: batch rows (heads default to 32/8 there)")
    bench.add_argument("--new", type=int, default=1, help="--decode: new query tokens per row")
    bench.add_argument("--page", type=int, default=None,
                       help="--decode: also time a paged cache of this page size (shuffled pages)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with _progress_on_stderr(), _warnings_as_lines():
        try:
            from ..runtime.settings import check_settings
            check_settings()  # a bad ATTNCC_* value: `error: ...`, exit 2
            return COMMANDS[args.command](args)
        except SpecError as err:
            print(str(err), file=sys.stderr)
            return 2
        except SpecWarning as err:  # python -W error: the warning raised, as asked
            print(f"error (a warning, raised under -W error): {err}", file=sys.stderr)
            return 2
        except AttnccError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            # The reader left (`attncc compile ... | head -1`): nothing more to say. stdout
            # points at /dev/null so that the interpreter's final flush raises nothing.
            import os
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0


@contextlib.contextmanager
def _warnings_as_lines():
    """A warning as one line on stderr, `attncc: SpecWarning: ...`, not Python's
    `<frozen runpy>:88: SpecWarning:` with the line of code that warned."""
    import warnings
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"attncc: {category.__name__}: {message}", file=sys.stderr)
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


@contextlib.contextmanager
def _progress_on_stderr():
    """Show attncc's progress lines (tuning) on stderr while a command runs. The library
    only logs them (logger "attncc.tuning", level INFO), so they stay quiet in programs
    that configure no logging."""
    logger = logging.getLogger("attncc")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("attncc: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def cmd_show(args) -> int:
    from .. import load
    sized = [f"--{n.replace('_', '-')}" for n in ("len", "len_k", "tile")
             if getattr(args, n) is not None]
    if sized and not args.plot:
        raise AttnccError(f"{', '.join(sized)} size the drawing of --plot, which was not asked "
                          "for; add --plot FILE.png, or leave them out")
    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise AttnccError(f"--plot {args.plot}: the drawing is a PNG; name the file FILE.png")
    variant = load(args.spec)
    if args.plot:
        from .extras import require_plotting
        require_plotting()
    print(variant, end="")
    if args.plot:
        from .plot import plot_variant
        len_q = 512 if args.len is None else args.len
        summary = plot_variant(variant, args.plot, len_q=len_q,
                               len_k=len_q if args.len_k is None else args.len_k,
                               tile=64 if args.tile is None else args.tile)
        print(f"wrote {args.plot}: {summary}")
    return 0


def cmd_compile(args) -> int:
    from .compile_command import compile_command
    return compile_command(args)


def cmd_check(args) -> int:
    from .check_command import check_command
    return check_command(args)


def check_bench_arguments(args) -> None:
    """The bench's flags, checked before a spec is compiled or a GPU looked for: a bad one
    found after minutes of timing (a --plot that is no PNG, a folder that is missing) loses
    the run, and a flag that does not apply would be ignored."""
    if args.decode:
        if args.plot:
            raise AttnccError("--plot draws the training bench's TFLOP/s; --decode has no "
                              "drawing: write its timings with --json FILE")
    else:
        given = [flag for flag, value, default in (("--batch", args.batch, 1),
                                                   ("--new", args.new, 1),
                                                   ("--page", args.page, None))
                 if value != default]
        if given:
            raise AttnccError(f"{', '.join(given)} set a decode step, which only --decode times; "
                              "add --decode, or leave them out (the training bench runs batch "
                              "16384 // len)")
    if args.dim < 1:
        raise AttnccError(f"--dim {args.dim}: a head dim is at least 1")
    if args.heads is not None and (min(args.heads) < 1 or args.heads[0] % args.heads[1]):
        raise AttnccError(f"--heads {args.heads[0]}/{args.heads[1]}: the query heads must be a "
                          "positive multiple of the key/value heads")
    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise AttnccError(f"--plot {args.plot}: the drawing is a PNG; name the file FILE.png")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise AttnccError(f"{flag} {path}: the folder {Path(path).resolve().parent} does not "
                              "exist; create it first")


def cmd_bench(args) -> int:
    check_bench_arguments(args)
    if args.decode:
        from .decode_bench import bench_decode_command
        return bench_decode_command(args)
    from .bench_command import bench_command
    return bench_command(args)


COMMANDS = {"show": cmd_show, "compile": cmd_compile, "check": cmd_check, "bench": cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
