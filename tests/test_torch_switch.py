"""Every test that needs the torch extra goes through `tests.extras.require_torch_extra`, so that it
skips without torch and fails in CI (`SLACKSWAP_REQUIRE_TORCH`): no test module imports torch or
transformers at its top, and none calls `pytest.importorskip` on them directly."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXTRA = {"torch", "transformers"}


def _top_level_extra_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] in EXTRA]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTRA:
            names.append(node.module)
    return names


def _direct_importorskips(tree: ast.Module) -> list[str]:
    return [
        node.args[0].value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
        and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in EXTRA
    ]


def test_the_checks_see_a_top_level_import_and_a_direct_importorskip() -> None:
    tree = ast.parse("import torch\nimport pytest\ntransformers = pytest.importorskip('transformers')\n")
    assert _top_level_extra_imports(tree) == ["torch"]
    assert _direct_importorskips(tree) == ["transformers"]


def test_torch_tests_use_the_one_switch() -> None:
    offenders = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        offenders += [f"{path.name}: top-level import {n}" for n in _top_level_extra_imports(tree)]
        offenders += [f"{path.name}: pytest.importorskip({n!r})" for n in _direct_importorskips(tree)]
    assert not offenders, "use tests.extras.require_torch_extra:\n" + "\n".join(offenders)
