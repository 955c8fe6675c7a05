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


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``make test``) with a file that imports another test file kept on
    that file's worker: test_compare reads test_strategies' cached ``autopar.compare`` run
    (eight strategies planned, compiled and timed), which a second worker would repeat."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _home(nodeid.split("::", 1)[0])

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
