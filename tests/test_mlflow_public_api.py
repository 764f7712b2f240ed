"""The project talks to MLflow through its public API only: no import of a private module (a path
segment with a leading underscore) or of the store's internals (`mlflow.store`), and no private
attribute of a client or store (`client._tracking_client`, `._store`). Each would tie the pins to one
MLflow release. Read with `ast`, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("slackswap", "pipelines", "hydra_plugins", "tools", "benchmarks", "scripts")
PRIVATE_ATTRIBUTES = {"_tracking_client", "_store", "_tracking_service", "_get_store", "_engine"}


def _offences(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "mlflow" and (any(p.startswith("_") for p in parts) or parts[:2] == ["mlflow", "store"]):
                found.append(f"{name}:{node.lineno}: imports {module}")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"{name}:{node.lineno}: uses .{node.attr}")
    return found


def test_the_scan_finds_what_it_forbids() -> None:
    source = ("from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore\n"
              "import mlflow.tracking._tracking_service.utils\n"
              "from mlflow.entities import Metric\n"
              "client._tracking_client.store\n")
    assert [o.split(": ", 1)[1] for o in _offences(source, "x.py")] == [
        "imports mlflow.store.tracking.sqlalchemy_store",
        "imports mlflow.store.tracking.sqlalchemy_store.SqlAlchemyStore",
        "imports mlflow.tracking._tracking_service.utils",
        "uses ._tracking_client",
    ]


def test_no_module_reaches_into_mlflow_internals() -> None:
    found = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            found += _offences(path.read_text(), str(path.relative_to(REPO)))
    assert found == []


def test_a_moved_store_module_costs_the_warm_up_not_the_run(tmp_path, monkeypatch) -> None:
    """open_client imports MLflow's SQLAlchemy store by name only to warm it up (collector paused, outside
    the lock): an MLflow that moves the module still opens the store."""
    from pipelines import heavy_imports, tracking

    real = heavy_imports.import_paused
    asked = []

    def moved(name: str):
        asked.append(name)
        if name == "mlflow.store.tracking.sqlalchemy_store":
            raise ModuleNotFoundError(name)
        return real(name)

    monkeypatch.setattr(heavy_imports, "import_paused", moved)
    client = tracking.open_client(f"sqlite:///{tmp_path}/mlflow.db")
    assert "mlflow.store.tracking.sqlalchemy_store" in asked
    assert [e.name for e in client.search_experiments()] == ["Default"]
