"""Shared test set-up: the Flower/Ray environment, the repository on sys.path, small fixtures."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.data.datasets import DEBIAN_FASHION_MNIST  # noqa: E402
from pflalign.engines.flower_process import set_flower_environment  # noqa: E402

set_flower_environment()
# transformers never tries the network in the tests (a subprocess inherits it)
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's loadfile hands files out in collection order (pytest_collection_modifyitems
    # below), rather than sorted by their number of tests
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.addinivalue_line("markers", "deployment: the slow integration test of a real Flower "
                            "deployment (minutes; deselect with -m 'not deployment')")
    config.addinivalue_line("markers", "slow: the extended integration cases, run apart from the "
                            "default suite (`make test-slow`, about 9 minutes on 2 cores): the "
                            "deployment across network namespaces, the deployment page's steps "
                            "word for word, bad nodes at discovery and a killed run, and the "
                            "language-model deployment")


#: the test files that take longest, with their seconds on a worker of the 2-core suite
#: (`pytest -n 2 --dist loadfile --durations=0`, summed per file, 2026-12-07): the suite hands
#: these out first, longest first, so that no long file starts last and leaves one worker
#: running alone at the end (longest-processing-time-first); the rest follow in file order
HEAVY_FILES = {
    "test_baselines_simulation.py": 142, "test_batched.py": 110, "test_checkpoint.py": 100,
    "test_strategies.py": 55, "test_study.py": 92, "test_attacks.py": 85,
    "test_language.py": 77, "test_simulation.py": 72, "test_saved_models.py": 68,
    "test_async.py": 57, "test_own_app.py": 54, "test_systems.py": 51, "test_probe.py": 49,
    "test_cli_checks.py": 48, "test_user_model.py": 45, "test_workers.py": 44,
    "test_deploy_resubmit.py": 43, "test_audit.py": 42, "test_interrupt.py": 36,
    "test_report.py": 35, "test_config.py": 33, "test_tables.py": 33,
    "test_docs_examples.py": 32, "test_robustness.py": 26, "test_eval_sample.py": 36,
    "test_population.py": 22}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (stable: a file's tests keep their order, and the other files
    theirs); pytest_configure has pytest-xdist's loadfile hand files out in this order."""
    items.sort(key=lambda item: -HEAVY_FILES.get(item.path.name, 0))


@pytest.fixture(autouse=True, scope="module")
def _module_outputs_removed(request: pytest.FixtureRequest,
                            tmp_path_factory: pytest.TempPathFactory):
    """The runs' folders a test file made (its module fixtures' ``tmp_path_factory`` ones; a
    passing test's ``tmp_path`` goes at once, by ``tmp_path_retention_policy``), removed when
    the file has passed: a run saves its models by default, and the suite would otherwise hold
    some 5 GB by its end. A failing file keeps them to look at."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before:
            shutil.rmtree(path, ignore_errors=True)


HAS_FASHION_MNIST = (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").exists()
needs_fashion_mnist = pytest.mark.skipif(
    not HAS_FASHION_MNIST,
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture
def labels_10k() -> object:
    """10,000 synthetic labels over 10 balanced classes, in shuffled order."""
    import numpy as np

    return np.random.default_rng(123).permutation(np.repeat(np.arange(10), 1000))


def assert_reported_accuracy_matches_its_clients(result: dict) -> None:
    """A method's final ``personal-acc`` is the test-size-weighted accuracy of its seen clients
    as listed in ``clients``, and ``unseen-acc`` that of its unseen clients: the reported
    numbers are exactly what the clients scored."""
    import pytest

    final, clients = result["final"], result["clients"]
    for key, group in (("personal-acc", [c for c in clients if not c["unseen"]]),
                       ("unseen-acc", [c for c in clients if c["unseen"]])):
        if not group:
            assert key not in final
            continue
        correct = sum(c["personal-acc"] * c["num-test"] for c in group)
        assert final[key] == pytest.approx(correct / sum(c["num-test"] for c in group),
                                           rel=1e-12)


def flwr_run(app: str | Path, tmp_path: Path, args: list[str], port: int,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """``flwr run <app> --stream <args>`` against Flower's managed local SuperLink, on its own
    ports (``port`` and ``port + 2``), FLWR_HOME and Ray directory; the SuperLink is stopped
    afterwards."""
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    bin_dir = os.path.dirname(sys.executable)  # flwr starts `flower-superlink` from PATH
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               FLWR_HOME=str(tmp_path / "flwr-home"), RAY_TMPDIR=ray_tmp,
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(port),
               FLWR_LOCAL_CONTROL_API_PORT=str(port + 2))
    try:
        return subprocess.run([os.path.join(bin_dir, "flwr"), "run", ".", "--stream", *args],
                              capture_output=True, text=True, timeout=timeout, cwd=app, env=env)
    finally:
        pids = subprocess.run(["pgrep", "-f", f"flower-superlink.*{tmp_path}"],
                              capture_output=True, text=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGTERM)
        shutil.rmtree(ray_tmp, ignore_errors=True)
