"""A real install: `pip install .` into a fresh virtualenv, then attncc used from elsewhere.

Editable installs read grammar/ and the templates from the checkout, so they cannot show
that a wheel carries them. This test builds and installs a wheel (no editable mode),
then runs from a directory outside the repository, where the checkout is not on the path.

The test is hermetic: it needs only what the README's test command installs. torch, the
other dependencies and the build backend (setuptools, which the `test` extra pins to a
version that builds wheels on its own) come from the environment running the tests, so
nothing is downloaded. That environment is often itself a virtualenv, so the new venv
cannot take them with `--system-site-packages`: that flag shows the *base* interpreter's
packages, which may lack torch, or carry a setuptools too old to build a wheel without
the `wheel` package (issue 16).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JUNK = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", "*.pyc", ".venv*", "venv")


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("packaging")
    # Build from a copy: an in-tree build would write build/ and *.egg-info into the
    # checkout that other work is using.
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=JUNK)
    env_dir = base / "venv"
    # --without-pip: pip and setuptools come from the running environment (below), not
    # from ensurepip's bundle, whose setuptools may be too old to build a wheel.
    run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    # The running environment's packages go *after* the venv's own site-packages on the
    # path (a .pth line appends), so the attncc installed below wins over the checkout's
    # editable install, whose import hook is not loaded: only the paths are added.
    venv_site = run([str(python), "-c",
                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    outer = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    Path(venv_site, "_running_environment.pth").write_text("\n".join(outer) + "\n")
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", str(source)], cwd=base)
    shutil.rmtree(source)  # the installed package must not need its source tree
    return env_dir, python, base


def test_installed_package_carries_its_grammar_and_templates(venv):
    env_dir, python, base = venv
    outside = base / "elsewhere"
    outside.mkdir()
    example = ROOT / "examples" / "sliding_window.attn"
    snippet = textwrap.dedent(f"""
        import sys, sysconfig
        from pathlib import Path
        import attncc
        from attncc import resources
        site = Path(sysconfig.get_paths()["purelib"]).resolve()
        checkout = Path({str(ROOT)!r}).resolve()
        from attncc.backends.portable import codegen as portable
        from attncc.backends.gluon import codegen as gluon
        from attncc.codegen import templating
        for found in (Path(attncc.__file__), resources.grammar_path(), portable.TEMPLATES,
                      gluon.TEMPLATES, templating.SHARED_TEMPLATES):
            found = found.resolve()
            assert found.is_relative_to(site), (found, site)
            assert not found.is_relative_to(checkout), found
        assert resources.grammar_path().is_file()
        for templates in (portable.TEMPLATES, gluon.TEMPLATES, templating.SHARED_TEMPLATES):
            assert any(templates.glob("*.jinja")), templates
        # rendering reaches every part the wheel ships
        assert "def attn_fwd(" in portable.generate(attncc.parse("attention c {{ mask q >= k }}")).source
        assert "@gluon.jit" in gluon.generate(attncc.parse("attention c {{ mask q >= k }}")).source
        v = attncc.parse_file({str(example)!r})
        assert v.name == "sliding_window" and v.param("window").value == 1024
        import attncc.flash, attncc.integrations.transformers
        # every stage of the pipeline is a subpackage the wheel must carry
        import attncc.frontend.parser, attncc.analysis.bounds, attncc.semantics.reference
        import attncc.backends.portable.codegen, attncc.runtime.kernel, attncc.runtime.packed, attncc.tools.cli
        assert Path(attncc.integrations.transformers.__file__).resolve().is_relative_to(site)
        from attncc.runtime import known_winners  # its table is package data
        assert known_winners.WINNERS_FILE.resolve().is_relative_to(site)
        known_winners.load_table()
        print("ok", resources.grammar_path())
    """)
    # -I: isolated mode, so neither the working directory nor PYTHONPATH can put the
    # checkout on the path.
    r = run([str(python), "-I", "-c", snippet], cwd=outside)
    assert r.stdout.startswith("ok ") and str(env_dir.resolve()) in r.stdout


def test_installed_console_script_shows_an_example(venv):
    env_dir, python, base = venv
    script = env_dir / ("Scripts" if os.name == "nt" else "bin") / "attncc"
    assert script.exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = run([str(script), "show", str(ROOT / "examples" / "causal.attn")], cwd=base, env=env)
    assert r.stdout == "attention causal {\n    mask    q >= k\n}\n"
    bad = base / "bad.attn"
    bad.write_text("attention a {\n    mask q >= kk\n}\n")
    r = subprocess.run([str(script), "show", "bad.attn"], capture_output=True, text=True,
                       cwd=base, env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("bad.attn:2:15: error: unknown name 'kk'")
