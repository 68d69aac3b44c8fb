"""Start a collector in a child process (demo, tests, benchmarks) and stop it cleanly."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

_LISTENING = re.compile(r"listening on (\S+),")
# Python children of crosstrace's own (the collector, the demo's workers) import the installed
# package, not a `crosstrace` folder where they run: from a clone of the repository (the
# README's quick start) `-m` found the clone's face package, without its subpackages.
CHILD_FLAGS = ("-P",)


class CollectorDidNotStart(RuntimeError):
    """The collector child exited before it listened; the message holds what it said."""


class CollectorProcess:
    """`crosstrace collector` as a child process; `address` is where tracers connect."""

    def __init__(self, store: str, listen: str = "127.0.0.1:0", extra_args: tuple = (),
                 timeout_s: float = 30.0, env: dict | None = None):
        self.store = store
        cmd = [sys.executable, *CHILD_FLAGS, "-m", "crosstrace", "collector", "--listen", listen, "--store", store,
               "--quiet", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)  # stopped by us, not Ctrl-C
        self.address = self._wait_listening(timeout_s)
        self.port = int(self.address.rsplit(":", 1)[1])
        self.stderr_lines: list[str] = []
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _wait_listening(self, timeout_s: float) -> str:
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                match = _LISTENING.search(line)
                if match:
                    return match.group(1)
        finally:
            timer.cancel()
        err = self.proc.stderr.read()
        raise CollectorDidNotStart(f"collector did not start (exit {self.proc.poll()}): {err.strip()}")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`. Once stopped,
        `stderr_lines` holds everything the collector wrote."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._finish()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self._finish()

    def _finish(self) -> None:
        """Take the last of its stderr, and close its pipes."""
        self._drainer.join(5)
        if not self._drainer.is_alive():
            self.proc.stderr.close()
        self.proc.stdout.close()

    def __enter__(self) -> "CollectorProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def free_port() -> int:
    """A TCP port on loopback that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
