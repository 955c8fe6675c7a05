"""Test set-up: 8 emulated CPU devices, requested before jax is imported anywhere."""
import functools
import os
import pathlib
import re

# LLVM at -O0 for the CPU backend: compiling is most of the suite's time and the tests check
# numbers, HLO and buffer assignments (which the HLO passes decide, not LLVM), never speed.
# About a quarter off each compile; benchmarks that time steps run without this flag.
_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAGS).strip()
os.environ.setdefault("AUTOPAR_CHECKS", "1")
# Golden plans must not depend on the machine's load: plan on the solver's deterministic clock
# (tests of the wall-clock budget pass deterministic=False).
os.environ.setdefault("AUTOPAR_DETERMINISTIC", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def mesh_8():
    return jax.sharding.Mesh(jax.devices()[:8], ("x",))


@pytest.fixture(scope="session")
def mesh_2x4():
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


# Files whose tests share nothing in the worker's process: each runs a subprocess (a benchmark's
# --quick mode), a notebook's kernel or a docs page in a fresh namespace. Scheduled test by test.
ONE_BY_ONE = frozenset(f"tests/test_{name}.py" for name in ("benchmarks_quick", "docs",
                                                            "notebooks"))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``make test``), two changes. A file that imports another test file
    runs on that file's worker: test_compare reads test_strategies' cached ``autopar.compare``
    run (eight strategies planned, compiled and timed), which a second worker would repeat.
    The tests of ``ONE_BY_ONE`` are units of their own: xdist hands out the units with the
    most tests first, so these come last, in pieces of under a minute on a quiet host, and even
    out the workers' ends (whole, the benchmarks' file is about 5 minutes on one worker)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in ONE_BY_ONE else _home(path)

    return SharedFileScheduling(config, log)


@functools.cache
def _home(path: str) -> str:
    """The test file whose worker runs ``path``: the one it imports (``from test_x import``),
    else itself."""
    file = pathlib.Path(path)
    found = file.suffix == ".py" and re.search(r"^from (test_\w+) import",
                                               (ROOT / file).read_text(), re.M)
    home = file.with_name(found.group(1) + ".py") if found else file
    return str(home) if (ROOT / home).exists() else path
