"""Every dotted `slackswap.` / `pipelines.` name that the docs and the docstrings mention resolves to a
module or an attribute of one, and every repository path the docs name exists, so a rename cannot
leave a document pointing at nothing.

Scanned: docs/*.md and README.md (CHANGELOG.md is history and may name what no longer exists), and
the docstrings of every Python file of the repository. In Markdown, a name written as a sibling of
the name before it on the same line (a backticked module path, a comma, then a backticked `.name`)
is resolved beside that module. File names (`slackswap.log`) and schema ids (`slackswap.advice/1`) are
not names.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from tests.extras import torch_required

ROOT = Path(__file__).resolve().parents[1]
#: A name followed by "/" is a schema id (`slackswap.advice/1`), not a name.
NAME = re.compile(r"(?<![\w./-])((?:slackswap|pipelines)(?:\.[A-Za-z_]\w*)+)(?![\w/])")
SIBLING = re.compile(r"`((?:slackswap|pipelines)(?:\.\w+)+)`((?:, `\.\w+`)+)")
FILE_SUFFIXES = {"log", "py", "json", "md", "yaml", "csv", "png", "db", "txt", "html"}
SKIP_DIRS = {".venv", ".venv-next", "outputs", "multirun", "mlruns", ".git", "node_modules"}
TORCH_MODULES = {"torch", "transformers"}
TOP_DIRS = "slackswap|pipelines|benchmarks|tools|tests|scripts|conf"
PATH = re.compile(rf"(?<![\w./-])((?:{TOP_DIRS})/[\w/.-]*\w\.(?:py|yaml|md))")


def _texts() -> list[tuple[str, str]]:
    documents = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in documents]
    for path in sorted(ROOT.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(ROOT).parts):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append((str(path.relative_to(ROOT)), doc))
    return texts


def mentioned_names(text: str) -> set[str]:
    names = {m.group(1) for m in NAME.finditer(text)}
    for m in SIBLING.finditer(text):
        parent = m.group(1).rsplit(".", 1)[0]
        names |= {f"{parent}.{s}" for s in re.findall(r"`\.(\w+)`", m.group(2))}
    return {n for n in names if n.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


def resolves(name: str) -> bool:
    """True when some prefix of `name` imports as a module and the rest are attributes along it. A
    module that needs the torch extra, where that is not installed (and not required), counts as
    resolved when its file exists: its attributes cannot be checked without importing it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name in TORCH_MODULES and not torch_required():
                return True
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_the_name_scanner_finds_names_and_siblings_and_skips_files() -> None:
    text = "see `slackswap.simulate.trace`, `.timeline` and slackswap.schedule.build; slackswap.log stays empty"
    assert mentioned_names(text) == {
        "slackswap.simulate.trace", "slackswap.simulate.timeline", "slackswap.schedule.build"}
    assert resolves("slackswap.schedule.build.build_schedule")
    assert not resolves("slackswap.schedule.build.no_such_function")
    assert not resolves("slackswap.no_such_module")


def test_every_dotted_name_in_docs_and_docstrings_resolves() -> None:
    mentioned = {(where, name) for where, text in _texts() for name in mentioned_names(text)}
    missing = sorted((where, name) for where, name in mentioned if not resolves(name))
    assert not missing, "names that do not resolve:\n" + "\n".join(f"{where}: {name}" for where, name in missing)


def test_every_repository_path_in_the_docs_exists() -> None:
    """Paths such as `slackswap/schedule/build.py` or `conf/model/tiny.yaml` in docs/*.md and README.md;
    `my_*` files are the docs' templates for a user's own preset or planner."""
    documents = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    missing = sorted(
        (str(doc.relative_to(ROOT)), path) for doc in documents for path in set(PATH.findall(doc.read_text()))
        if not Path(path).name.startswith("my_") and not (ROOT / path).exists()
    )
    assert not missing, "paths that do not exist:\n" + "\n".join(f"{doc}: {path}" for doc, path in missing)
