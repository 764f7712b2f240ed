"""Shared fixtures. Generic on purpose: nothing here changes how other tests run.

`mlflow_store`: a fresh, empty MLflow SQLite store plus an artifact root, both under the test's
tmp_path. Creating the SQLite schema costs ~1.3 s on 2 cores, so it is created once per session (once
per pytest-xdist worker) in a template file and copied for each test (about 10x faster), which also
keeps tests independent.

`TORCHINDUCTOR_VEC_ISA_OK=1` (set unless the environment already sets it; subprocesses inherit it): the
tests that compile with inductor on the CPU skip inductor's SIMD probe. Without it, a process's first
compile builds and loads a test program per instruction set its CPU advertises
(`torch._inductor.cpu_vec_isa.VecISA.check_build`): about 7 s of CPU on a cold inductor cache, which a
fresh machine has (the 4 compiled-partition tests of test_runtime_export.py, cold, one process: 66.7 s
user+sys without, 59.8 s with). With it, inductor takes the instruction sets from the CPU's flags alone.
It changes nothing the tests check: on the development machine both ways pick the same list (avx512
avx512_vnni, avx512, avx2) and so the same generated code; a compiler that could not build an
advertised set would fail the compile loudly, not change a result.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# Before anything imports torch._inductor.config, which reads it once (see the docstring).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Tests write nothing outside temporary directories: no example database, and Hypothesis' own cache
# (it writes ./.hypothesis/constants even without a database) goes to a temporary folder.
settings.register_profile("slackswap", database=None)
settings.load_profile("slackswap")
_hypothesis_home = tempfile.TemporaryDirectory(prefix="slackswap-hypothesis-")
atexit.register(_hypothesis_home.cleanup)
set_hypothesis_home_dir(_hypothesis_home.name)


@dataclass(frozen=True)
class MlflowStore:
    db_path: Path
    artifact_root: Path

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.db_path}"

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="session")
def _mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow.tracking import MlflowClient  # a dependency of the package: missing, the tests fail

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # creates and migrates the schema
    return path


@pytest.fixture
def mlflow_store(tmp_path: Path, _mlflow_template_db: Path) -> MlflowStore:
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir(parents=True)
    shutil.copyfile(_mlflow_template_db, db)
    artifacts = tmp_path / "mlflow" / "artifacts"
    artifacts.mkdir()
    return MlflowStore(db_path=db, artifact_root=artifacts)
