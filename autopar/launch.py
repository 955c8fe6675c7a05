"""An elastic launcher for one machine: start N processes of a training script on
``jax.distributed``; when one dies, stop the rest and start the job again on the processes left.

    python -m autopar.launch --nproc 2 --devices-per-process 4 --max-restarts 2 -- train.py ...

Each process gets ``JAX_COORDINATOR_ADDRESS`` (a fresh local port per attempt),
``AUTOPAR_NUM_PROCESSES``, ``AUTOPAR_PROCESS_ID``, ``AUTOPAR_RESTART`` and ``AUTOPAR_NODE`` (its
own, so each process stands for one host); ``autopar.distributed.initialize()`` reads them. With
``--devices-per-process`` on CPU, ``XLA_FLAGS`` asks for that many emulated devices.

The script makes itself elastic: it plans for the devices it finds, restores the latest
checkpoint (``autopar.checkpoint``), which re-plans when the mesh changed, and continues from the
step counter saved in it. A process that dies takes its "host" with it: the next attempt runs
with the processes that were still alive (``shrink=True``) or with as many as before. On a real
cluster the scheduler plays this role (see docs/guides/multi-host.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from autopar import distributed

_POLL_S = 0.05
_GRACE_S = 3.0


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of the job: how many processes, how each ended, which ones failed first."""

    num_processes: int
    exit_codes: tuple[int | None, ...]     # None: stopped by the launcher (after another failed)
    failed: tuple[int, ...]                # the process ids that died on their own
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.timed_out


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    attempts: tuple[Attempt, ...]

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].ok


def free_port(avoid: Sequence[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), not in ``avoid``
    (so a restarted job never meets its predecessor's coordinator)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def launch(argv: Sequence[str], *, num_processes: int, devices_per_process: int | None = None,
           max_restarts: int = 3, min_processes: int = 1, shrink: bool = True,
           timeout_s: float | None = None, log_dir: str | None = None,
           env: Mapping[str, str] | None = None) -> LaunchResult:
    """Run ``python argv...`` as a job of ``num_processes`` processes, restarting after failures.

    Args:
      argv: the script and its arguments (run with this interpreter).
      num_processes: processes of the first attempt.
      devices_per_process: emulated CPU devices per process (sets ``XLA_FLAGS``); ``None``
        leaves the devices to jax.
      max_restarts: how many times to start again after a failure.
      min_processes: give up when fewer processes than this are left.
      shrink: restart with the processes that did not fail (the devices left), else with as
        many as before.
      timeout_s: wall-clock limit per attempt; a job past it is stopped and not restarted.
      log_dir: write ``attempt<k>.process<i>.log`` there (stdout and stderr) instead of
        inheriting this process's output.
      env: extra environment for every process.

    Every child is stopped before this returns, whatever happens.
    """
    attempts: list[Attempt] = []
    ports: list[int] = []
    n = num_processes
    for restart in range(max_restarts + 1):
        ports.append(free_port(avoid=ports))
        attempt = _attempt(argv, n, restart, ports[-1], devices_per_process, timeout_s, log_dir,
                           env)
        attempts.append(attempt)
        if attempt.ok or attempt.timed_out:
            break
        n = n - len(attempt.failed) if shrink else n
        if n < min_processes:
            break
    return LaunchResult(tuple(attempts))


def _attempt(argv, n, restart, port, devices, timeout_s, log_dir, extra_env) -> Attempt:
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    try:
        for pid in range(n):
            out = None
            if log_dir is not None:
                os.makedirs(log_dir, exist_ok=True)
                out = open(os.path.join(log_dir, f"attempt{restart}.process{pid}.log"), "w")
                logs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, *argv], env=_child_env(pid, n, port, restart, devices, extra_env),
                stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True))
        return _watch(procs, n, t0, timeout_s)
    finally:
        for p in procs:
            _stop(p)
        for f in logs:
            f.close()


def _watch(procs, n, t0, timeout_s) -> Attempt:
    """Poll until every process exits 0, one fails, or the time is up."""
    while True:
        codes = [p.poll() for p in procs]
        failed = tuple(i for i, c in enumerate(codes) if c not in (None, 0))
        elapsed = time.monotonic() - t0
        if failed or all(c == 0 for c in codes):
            return Attempt(n, tuple(codes), failed, elapsed)
        if timeout_s is not None and elapsed > timeout_s:
            return Attempt(n, tuple(codes), (), elapsed, timed_out=True)
        time.sleep(_POLL_S)


def _child_env(pid, n, port, restart, devices, extra) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(pid),
                distributed.ENV_RESTART: str(restart),
                distributed.ENV_NODE: f"{socket.gethostname()}/process{pid}"})
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _stop(p: subprocess.Popen) -> None:
    """Stop a child and everything it started (its own session): TERM, then KILL."""
    if p.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, _GRACE_S)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopar.launch", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="processes of the first attempt")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="emulated CPU devices per process (XLA_FLAGS)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--min-processes", type=int, default=1)
    p.add_argument("--no-shrink", action="store_true",
                   help="restart with as many processes as before instead of those left")
    p.add_argument("--timeout", type=float, default=None, help="seconds per attempt")
    p.add_argument("--log-dir", default=None)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    a = p.parse_args(argv)
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        p.error("give the script to run after --")
    result = launch(script, num_processes=a.nproc, devices_per_process=a.devices_per_process,
                    max_restarts=a.max_restarts, min_processes=a.min_processes,
                    shrink=not a.no_shrink, timeout_s=a.timeout, log_dir=a.log_dir)
    for k, att in enumerate(result.attempts):
        print(f"autopar.launch: attempt {k}: {att.num_processes} processes, exit codes "
              f"{list(att.exit_codes)}, failed {list(att.failed)}, {att.seconds:.1f} s"
              + (" (timed out)" if att.timed_out else ""), file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
