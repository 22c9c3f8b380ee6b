"""The documentation names what exists and shows code that runs.

Fast checks: every repository path that README.md, docs/*.md and tests/README.md name
(in backticks or as a link) exists, and every one the package's own comments,
docstrings and templates name; tests/README.md lists every test file and every GPU
script; the README's test command is the one .ci/run runs. Slow checks run the README's
Python snippets, in order in one namespace as a reader would, with the kernels under the
Triton interpreter (the context-parallel one with torchrun on two gloo ranks).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TESTS_README = ROOT / "tests" / "README.md"
DOCS = [README, TESTS_README, *sorted((ROOT / "docs").glob("*.md"))]

# What a repository path starts with, when it is written from the repository root.
TOP_LEVEL = ("attncc/", "tests/", "benchmarks/", "docs/", "examples/", "grammar/", ".ci/",
             "README.md", "pyproject.toml")
EXTENSIONS = (".py", ".sh", ".attn", ".jinja", ".json", ".lark", ".md", ".png", ".toml")
# File names the pages use for the reader's own files, not the repository's.
READERS_FILES = {"file.py", "FILE.py", "FILE.pt", "F.png", "cp_demo.py", "NAME.attn"}


def _named_paths(doc: Path) -> list[str]:
    text = doc.read_text()
    tokens = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    paths = []
    for token in tokens:
        token = token.split(":")[0].rstrip(".,;")  # `file.py:name`, `.ci/run`
        if "://" in token or "<" in token or token.startswith(".") and "/" not in token:
            continue  # a web address, a pattern, or a bare extension (`.attn` files)
        if token.startswith(TOP_LEVEL) or token.startswith("../") or token.endswith(EXTENSIONS):
            paths.append(token)
    return paths


def _file_names() -> set:
    """Names of the repository's files, outside hidden folders (.git, caches)."""
    names = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"]
        names.update(files)
    return names


def _exists(token: str, doc: Path, file_names: set) -> bool:
    if "/" not in token:  # a bare file name (a table of tests or scripts): somewhere here
        return token in READERS_FILES or token in file_names
    for base in (ROOT, doc.parent):
        if "*" in token:
            if any(base.glob(token)):
                return True
        elif (base / token).exists():
            return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    paths = _named_paths(doc)
    assert paths, f"{doc} names no repository path: the extraction is broken"
    file_names = _file_names()
    missing = sorted({p for p in paths if not _exists(p, doc, file_names)})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


# A path named in the package's comments, docstrings and templates: from the repository
# root or from attncc/ (`backends/gluon/codegen.py`), with a folder in it (a bare file
# name is a local reference the reader resolves nearby).
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+(?:\.py)?\.(?:py|jinja|md|json|lark|attn))\b")
# Other projects' files, named as their sources.
OTHER_PROJECTS = {"flash_attn/flash_attn_interface.py"}


def test_every_path_the_package_names_exists():
    """Comments that name a file name one that exists: moving a module or a template
    leaves no pointer to where it used to be (issue 29 counted nine such)."""
    package = ROOT / "attncc"
    missing = []
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.jinja")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for token in PACKAGE_PATH.findall(line):
                if token in OTHER_PROJECTS:
                    continue
                if not any((base / token).exists() for base in (ROOT, package, path.parent)):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {token}")
    assert len(missing) == 0, "paths named in the package that do not exist:\n" + "\n".join(missing)


def test_tests_readme_lists_every_test_file_and_gpu_script():
    listed = set(re.findall(r"`([\w./]+\.(?:py|sh))`", TESTS_README.read_text()))
    listed = {Path(name).name for name in listed}
    tests = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert not tests - listed, f"tests/README.md does not list {sorted(tests - listed)}"
    assert not scripts - listed, f"tests/README.md does not list {sorted(scripts - listed)}"
    stale = {n for n in listed if n.startswith("test_") and n not in tests}
    assert not stale, f"tests/README.md lists test files that do not exist: {sorted(stale)}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if line.startswith("pip install"))
    assert f"```\n{command}\n```" in README.read_text()
    assert "attncc check examples/causal.attn" in README.read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _is_torchrun(block: str) -> bool:
    return block.startswith("# torchrun")


@pytest.mark.slow
def test_readme_snippets_run(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(ROOT)  # the snippets name examples/ from the repository root
    namespace: dict = {}
    blocks = [b for b in _python_blocks() if not _is_torchrun(b)]
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        exec(compile(block, f"<README.md python block {i}>", "exec"), namespace)
    assert "OK" in capsys.readouterr().out  # kernel.check's report


@pytest.mark.slow
def test_readme_context_parallel_snippet_runs(tmp_path):
    (block,) = [b for b in _python_blocks() if _is_torchrun(b)]
    script = tmp_path / "cp_demo.py"
    script.write_text(block + 'print("gathered", tuple(whole.shape))\n')
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(script)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("gathered (1, 4, 512, 64)") == 2
