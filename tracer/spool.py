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
import stat
import tempfile
import threading

log = logging.getLogger("crosstrace.tracer")

_BATCH = re.compile(r"^(\d+)-(\d+)-(\d+)\.batch$")
_LOCK = "lock"
_SENDING = "sending"   # in a children's folder while the process they hand over to sends


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

    def handed_over(self, item: Spooled) -> None:
        """A forked child's batch that its parent sent and removed."""
        with self._lock:
            self.bytes -= item.size

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


def children_folder(spool_dir: str, session_id: bytes) -> tuple[str, str]:
    """(root, node folder name) of the spools a process's forked children hand their batches
    over in: under its own spool_dir where it has one (a later process there replays what is
    left), else in a folder of this user's under the temporary folder."""
    root = spool_dir or os.path.join(tempfile.gettempdir(), f"crosstrace-{os.getuid()}")
    return root, f"children-of-{session_id.hex()}"


def parent_sends(spool_dir: str, session_id: bytes, pid: int) -> bool:
    """Whether the process (session, pid) takes what its children hand over: its tracer
    lives (ChildBatches.open, not closed yet) and so does the process."""
    root, name = children_folder(spool_dir, session_id)
    if not os.path.exists(os.path.join(root, name, _SENDING)):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # alive, another user's (a pid reused): not the parent
        return False
    return True


class ChildBatches:
    """The batches this process's forked children left in their spools (children_folder),
    for this process to send: taken while the children live, each removed once acked.
    A child's folder goes once it is empty and its child is gone (its lock is free)."""

    def __init__(self, spool_dir: str, session_id: bytes):
        self.spool_dir = spool_dir
        root, name = children_folder(spool_dir, session_id)
        self.dir = os.path.join(root, name)
        self.open = False
        self._known: set[str] = set()

    def start(self) -> None:
        """Before the first fork: the folder, marked as taken from (parent_sends). Raises
        OSError where it cannot be made, or the temporary one is not this user's own."""
        root = os.path.dirname(self.dir)
        if not self.spool_dir:
            os.makedirs(root, mode=0o700, exist_ok=True)
            st = os.lstat(root)
            if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{root} is not this user's own folder")
            if st.st_mode & 0o077:   # spans are nobody else's to read
                os.chmod(root, 0o700)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with open(os.path.join(self.dir, _SENDING), "w"):
            pass
        self.open = True

    def new(self) -> tuple[list[Spooled], list[str]]:
        """(batches not taken before, each child's in the order it wrote them; paths taken
        before that are gone unacked: dropped by their child, its spool full, or taken by
        another process that spools there once the child was gone)."""
        found, present = [], set()
        try:
            children = sorted(os.scandir(self.dir), key=_mtime)
        except OSError:   # no child has handed anything over
            children = []
        for child in children:
            paths = [(match, os.path.join(child.path, match[0]))
                     for match in map(_BATCH.match, _names(child.path)) if match]   # (none in the `sending` mark)
            if not paths and child.is_dir():
                _remove_if_gone(child.path)
            present.update(path for _, path in paths)
            batches = [(int(match[1]), path, int(match[2]), int(match[3]))
                       for match, path in paths if path not in self._known]
            for _, path, seq, spans in sorted(batches):
                try:
                    found.append(Spooled(path, seq, spans, os.path.getsize(path)))
                except OSError:
                    continue
                self._known.add(path)
        vanished = list(self._known - present)
        self._known.difference_update(vanished)
        return found, vanished

    def remove(self, item: Spooled) -> None:
        try:
            os.unlink(item.path)
        except FileNotFoundError:   # its child's folder adopted by another process meanwhile
            pass
        self._known.discard(item.path)

    def close(self) -> None:
        """No more taking: the mark goes, so do the folders of children that are gone, and
        the children's folder if it is empty then. Outside a spool_dir nothing would ever
        send what is left there (counted lost by the exporter): that goes too."""
        if not self.open:
            return
        self.open = False
        try:
            os.unlink(os.path.join(self.dir, _SENDING))
        except OSError:
            pass
        try:
            children = [entry.path for entry in os.scandir(self.dir) if entry.is_dir()]
        except OSError:
            return
        for child in children:
            left = [name for name in _names(child) if _BATCH.match(name)]
            if not left or not self.spool_dir:
                _remove_if_gone(child, left)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _remove_if_gone(folder: str, batches: list[str] = ()) -> None:
    """Remove a child's spool folder (and the batches named) once its child has let go of the lock."""
    try:
        fd = os.open(os.path.join(folder, _LOCK), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for name in batches:
            os.unlink(os.path.join(folder, name))
        os.unlink(os.path.join(folder, _LOCK))
        os.rmdir(folder)
    except OSError:   # the child lives on (or wrote a batch meanwhile)
        pass
    finally:
        os.close(fd)


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0
