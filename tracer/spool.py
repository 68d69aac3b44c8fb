"""A bounded on-disk queue of serialized batches, for when the collector is out of reach.

Layout: <spool_dir>/<node>/<session>/<number>-<seq>-<spans>.batch, one file per batch, each
written whole or not at all (written aside, then renamed). A process holds an flock on
its session folder's `lock` file while it lives. A folder whose lock is free belongs to a
process that is gone: the next process that spools there adopts its batches (taking the
lock) and replays them, whatever its node id (the default one, `<host>/<pid>`, is new in
every process). Every batch keeps its own (session_id, seq), so the collector's
batch-level dedup stores nothing twice however often a batch is replayed.

Files are fsynced only with `fsync` (a relay under `--sync full`): like the collector's
default store, a spooled batch otherwise survives the process being killed, not a power
loss. The exporter decides what to keep when the spool
is full (the oldest batch goes, its spans counted as dropped); this class only keeps the
files and their sizes.
"""
import fcntl
import logging
import os
import re
import threading

log = logging.getLogger("crosstrace.tracer")

_BATCH = re.compile(r"^(\d+)-(\d+)-(\d+)\.batch$")
_LOCK = "lock"


def _fsync_dir(path: str) -> None:
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _safe(name: str) -> str:
    """A node id as one folder name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class Spooled:
    """One batch on disk: its seq (within its own session) and span count ride in its name."""

    __slots__ = ("path", "seq", "spans", "size")

    def __init__(self, path: str, seq: int, spans: int, size: int):
        self.path = path
        self.seq = seq
        self.spans = spans
        self.size = size


class Spool:
    def __init__(self, root: str, node_id: str, session_id: bytes, fsync: bool = False):
        self.root = root
        self.fsync = fsync
        node_dir = os.path.join(root, _safe(node_id))
        self.dir = os.path.join(node_dir, session_id.hex())
        self.bytes = 0                  # of every batch this spool holds, own and adopted
        self._number = 0
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # folder -> fd holding its lock (own and adopted)
        # Made under a hidden name and locked before it shows: another process's adopt() could
        # otherwise take the new, empty folder for a dead one's and remove it.
        making = os.path.join(node_dir, "." + session_id.hex())
        try:
            os.makedirs(making, exist_ok=True)
        except FileNotFoundError:   # the node's folder, just made, removed by a process leaving it empty
            os.makedirs(making, exist_ok=True)
        if not self._take(making):
            raise OSError(f"spool folder {making} is locked by another process")
        os.replace(making, self.dir)
        self._held[self.dir] = self._held.pop(making)
        if fsync:   # the folders too: a batch fsynced into a folder that a power loss takes is lost
            for folder in (node_dir, root):
                _fsync_dir(folder)

    # -- files ----------------------------------------------------------------------------

    def write(self, data: bytes, seq: int, spans: int) -> Spooled:
        with self._lock:
            self._number += 1
            name = f"{self._number:012d}-{seq}-{spans}.batch"
        path = os.path.join(self.dir, name)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:   # the rename too
            _fsync_dir(self.dir)
        with self._lock:
            self.bytes += len(data)
        return Spooled(path, seq, spans, len(data))

    @staticmethod
    def read(item: Spooled) -> bytes | None:
        """The batch, or None when its file is gone (acked or dropped meanwhile)."""
        try:
            with open(item.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def remove(self, item: Spooled) -> None:
        try:
            os.unlink(item.path)
        except FileNotFoundError:
            return
        with self._lock:
            self.bytes -= item.size
        folder = os.path.dirname(item.path)
        if folder != self.dir:
            self._release_if_empty(folder)

    # -- other sessions ---------------------------------------------------------------------

    def adopt(self) -> list[Spooled]:
        """Batches left by processes that are gone (their locks are free), any node's, oldest
        first. Their folders stay locked by this spool until their last batch is removed."""
        found = []
        try:
            nodes = [entry.path for entry in os.scandir(self.root) if entry.is_dir()]
        except OSError:
            return found
        sessions = []
        for node in nodes:
            try:
                sessions.extend(os.scandir(node))
            except OSError:   # gone meanwhile: its last process left it empty (_release_if_empty)
                continue
        sessions.sort(key=_mtime)
        for entry in sessions:
            if (not entry.is_dir() or entry.name.startswith(".") or entry.path == self.dir
                    or not self._take(entry.path)):
                continue
            batches = []
            try:
                for item in os.scandir(entry.path):
                    match = _BATCH.match(item.name)
                    if match:
                        number, seq, spans = map(int, match.groups())
                        batches.append((number, Spooled(item.path, seq, spans, item.stat().st_size)))
                    elif item.name.endswith(".tmp"):
                        os.unlink(item.path)   # a write that never finished
            except OSError:   # removed meanwhile: its owner closed it empty as this process took it
                self._release_if_empty(entry.path)
                continue
            batches.sort(key=lambda b: b[0])
            for _, item in batches:
                found.append(item)
                self.bytes += item.size
            if not batches:
                self._release_if_empty(entry.path)
        if found:
            log.info("crosstrace: replaying %d spooled batches (%d spans) left by earlier processes",
                     len(found), sum(item.spans for item in found))
        return found

    def _take(self, folder: str) -> bool:
        """Lock a session folder for this process; False when a live process holds it."""
        try:
            fd = os.open(os.path.join(folder, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[folder] = fd
        return True

    def _release_if_empty(self, folder: str) -> None:
        """Remove a session folder left with no batch, and its node's folder if that is empty
        now (one per process, under default node ids: adopt() scanned them all)."""
        try:
            if any(_BATCH.match(name) for name in os.listdir(folder)):
                return
            os.unlink(os.path.join(folder, _LOCK))
            os.rmdir(folder)
            os.rmdir(os.path.dirname(folder))
        except OSError:
            pass
        fd = self._held.pop(folder, None)
        if fd is not None:
            os.close(fd)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release every lock; this session's folder goes if nothing is left in it."""
        self._release_if_empty(self.dir)
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited lock descriptors (the parent's locks stay
        held by the parent) without touching the parent's files."""
        for fd in self._held.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._held.clear()


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0
