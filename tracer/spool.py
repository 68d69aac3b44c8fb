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
import tempfile
import threading

log = logging.getLogger("crosstrace.tracer")

_BATCH = re.compile(r"^(\d+)-(\d+)-(\d+)\.batch$")
_LOCK = "lock"
_SENDING = "sending"   # in a children's folder while the process they hand over to sends
_CHILDREN = "children-of-"   # a children's folder in a spool_dir: children-of-<session>


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
    def __init__(self, root: str, node_id: str, session_id: bytes, fsync: bool = False,
                 make_folders: bool = True):
        """`make_folders`: make the root and the node's folder where missing (a forked
        child's spool goes only into the folder its parent made: see child_spool)."""
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
        if not make_folders:
            os.mkdir(making, 0o700)
        else:
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
        """A batch acked or given up (once each); its file may be gone already, sent and
        removed by another process (an adopted folder, a forked child's handover)."""
        try:
            os.unlink(item.path)
        except FileNotFoundError:
            pass
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
                entries = list(os.scandir(node))
            except OSError:   # gone meanwhile: its last process left it empty (_release_if_empty)
                continue
            sessions.extend(entries)
            if os.path.basename(node).startswith(_CHILDREN) and not any(entry.is_dir() for entry in entries):
                remove_if_abandoned(node)   # a killed parent's children's folder, left with its mark only
        sessions.sort(key=_mtime)
        for entry in sessions:
            if (not entry.is_dir() or entry.name.startswith(".") or entry.path == self.dir
                    or not self._take(entry.path)):
                continue
            try:
                batches = _spooled_in(entry.path, owner_gone=True)
            except OSError:   # removed meanwhile: its owner closed it empty as this process took it
                self._release_if_empty(entry.path)
                continue
            for item in batches:
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
        except OSError:
            pass
        else:
            remove_if_abandoned(os.path.dirname(folder))
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


def parent_sends(folder: str) -> bool:
    """Whether the process that made `folder` (ChildBatches.start) still takes what its
    children hand over there: its tracer holds the mark's lock while it does. (A lock, not
    the pid: a killed parent not yet reaped is a zombie that kill(pid, 0) still finds.)"""
    try:
        fd = os.open(os.path.join(folder, _SENDING), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:   # out of descriptors, say: no sign that the parent stopped
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False   # nobody holds it
    except OSError:
        return True
    finally:
        os.close(fd)


def remove_if_abandoned(folder: str) -> None:
    """A children's folder whose parent is gone keeps its mark, its lock free: the mark
    goes, and the folder if nothing else is left in it (a killed parent's, by its last
    child or by the next process that spools there). Also any empty node folder."""
    path = os.path.join(folder, _SENDING)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:   # its parent still takes from there
            return
        finally:
            os.close(fd)
    try:
        os.rmdir(folder)
    except OSError:
        pass


def child_spool(folder: str, session_id: bytes, fsync: bool) -> Spool:
    """A forked child's spool, in the folder its parent takes batches from; OSError where
    that folder is gone (its parent's tracer shut down): never made again by the child."""
    return Spool(os.path.dirname(folder), os.path.basename(folder), session_id, fsync, make_folders=False)


def tell_parent(folder: str) -> None:
    """A forked child wrote batches: the folder's time changes, which the parent's polls
    look at (ChildBatches.changed), not every child's folder."""
    try:
        os.utime(folder)
    except OSError:   # the parent's full rounds find the batches all the same
        pass


class ChildBatches:
    """The batches this process's forked children hand over, each in a spool of its own
    in one folder (`dir`): under this process's spool_dir, where a later process that
    spools there sends what is left, else a private temporary folder. Taken while the
    children live, each removed once acked; a child's folder goes once its child is gone
    (its lock is free) and nothing of it is left to send."""

    def __init__(self, spool_dir: str, session_id: bytes):
        self.spool_dir = spool_dir
        self.session_id = session_id
        self.dir: str | None = None     # made before the first fork
        self._mark = None               # the mark's descriptor, locked while this process takes
        self._known: set[str] = set()
        self._seen = None               # the folder's time at the last look
        self.has_children = False       # whether children's folders were there at the last look

    def start(self) -> None:
        """Before the first fork: the folder, marked as taken from (parent_sends)."""
        if self.spool_dir:   # made hidden, and shown once its mark is locked (see Spool.adopt)
            name = f"{_CHILDREN}{self.session_id.hex()}"
            os.makedirs(self.spool_dir, exist_ok=True)
            making = tempfile.mkdtemp(prefix=f".{name}-", dir=self.spool_dir)
            folder = os.path.join(self.spool_dir, name)
        else:   # a name nobody can take first, and a folder only this user can read
            making = folder = tempfile.mkdtemp(prefix="crosstrace-children-")
        fd = os.open(os.path.join(making, _SENDING), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if making != folder:
            os.replace(making, folder)
        self.dir, self._mark = folder, fd

    def forget_after_fork(self) -> None:
        """In a forked child: the inherited descriptor of the parent's mark closes (the lock
        belongs to the open file, which the parent keeps: a child must not keep it)."""
        if self._mark is not None:
            os.close(self._mark)
            self._mark = None

    def stop_taking(self) -> None:
        """Children that look from now on send what they hold themselves. (Those that looked
        before wrote their batches first: new() after this finds them.)"""
        if self._mark is not None:
            try:
                os.unlink(os.path.join(self.dir, _SENDING))
            except OSError:
                pass
            os.close(self._mark)
            self._mark = None

    def changed(self) -> bool:
        """Whether a child told of batches since the last look (one stat; the clock behind
        a folder's time is coarse, so full rounds look regardless)."""
        try:
            return os.stat(self.dir).st_mtime_ns != self._seen
        except (OSError, TypeError):
            return False

    def new(self, tidy: bool = True) -> tuple[list[Spooled], list[str]]:
        """(batches not taken before, each child's in the order it wrote them; paths taken
        before that are gone unacked: dropped by their child, its spool full, or sent by
        another process or by the child itself). `tidy`: remove gone children's empty folders."""
        found, present = [], set()
        try:
            self._seen = os.stat(self.dir).st_mtime_ns   # before the look: a change during it is seen next time
        except (OSError, TypeError):
            pass
        children = self._children()
        self.has_children = bool(children)
        for child in children:
            try:
                batches = _spooled_in(child)
            except OSError:   # adopted and emptied by another process (its child gone)
                continue
            if not batches and tidy:
                _remove_if_gone(child)
            present.update(item.path for item in batches)
            found.extend(item for item in batches if item.path not in self._known)
        self._known.update(item.path for item in found)
        vanished = list(self._known - present)
        self._known.difference_update(vanished)
        return found, vanished

    def remove(self, item: Spooled) -> None:
        try:
            os.unlink(item.path)
        except FileNotFoundError:   # its child's folder adopted by another process meanwhile
            pass
        self._known.discard(item.path)

    def close(self) -> int:
        """At shutdown, after the last new(): the folders of children that are gone, and the
        folder itself if it is empty then. Outside a spool_dir nothing would ever send what
        gone children left there: that goes too. Returns the spans of batches removed that
        were never taken (for the exporter to count)."""
        self.stop_taking()
        untaken = 0
        for child in self._children():
            try:
                left = _spooled_in(child)
            except OSError:
                continue
            if left and self.spool_dir:
                continue
            if _remove_if_gone(child, with_batches=True):
                untaken += sum(item.spans for item in left if item.path not in self._known)
        if self.dir is not None:
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
        return untaken

    def _children(self) -> list[str]:
        """The children's spool folders, oldest first (not the mark, a file)."""
        try:   # (a child's folder being made is hidden: see Spool)
            entries = [entry for entry in os.scandir(self.dir) if entry.is_dir() and not entry.name.startswith(".")
                       ] if self.dir else []
        except OSError:
            return []
        return [entry.path for entry in sorted(entries, key=_mtime)]


def _spooled_in(folder: str, owner_gone: bool = False) -> list[Spooled]:
    """The batches in a session folder, in the order they were written; OSError where the
    folder is gone. `owner_gone`: a write of its owner's that never finished goes too."""
    batches = []
    for item in os.scandir(folder):
        match = _BATCH.match(item.name)
        try:
            if match:
                number, seq, spans = map(int, match.groups())
                batches.append((number, Spooled(item.path, seq, spans, item.stat().st_size)))
            elif owner_gone and item.name.endswith(".tmp"):
                os.unlink(item.path)
        except FileNotFoundError:   # sent and removed meanwhile
            continue
    return [item for _, item in sorted(batches, key=lambda b: b[0])]


def _remove_if_gone(folder: str, with_batches: bool = False) -> bool:
    """Remove a child's spool folder (and a write a kill cut short; `with_batches`: its
    batches too) once its child has let go of the lock. Whether it was removed."""
    try:
        fd = os.open(os.path.join(folder, _LOCK), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for item in _spooled_in(folder, owner_gone=True):
            if with_batches:
                os.unlink(item.path)
        os.unlink(os.path.join(folder, _LOCK))
        os.rmdir(folder)
        return True
    except OSError:   # the child lives on (or left batches)
        return False
    finally:
        os.close(fd)


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0
