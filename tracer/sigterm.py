"""SIGTERM in a multiprocessing child: its tracers hand their spans over first.

`with multiprocessing.Pool() as p:` ends its workers by SIGTERM (Pool.terminate()), idle
or in the middle of their own exit, and they lost up to an export interval of spans,
uncounted. A Python signal handler would run only once the main thread runs Python
again: a worker busy in a long call into C (a numpy task, a collective waiting for a dead
rank) would outlive SIGTERM, and Pool.terminate() would wait for it. So the handler does
nothing itself: Python's C-level handler also writes the signal's number to a wakeup
pipe, and a thread of crosstrace's, woken by it whatever the main thread is doing, shuts
the tracers down and then ends the process by SIGTERM, as it would have ended.

Only where SIGTERM has its default action and no wakeup fd is set (asyncio's): a
program's own handler, set before or after, keeps SIGTERM for itself. A program that
takes the wakeup fd later (asyncio's loop.add_signal_handler, for any signal; closing that
loop clears it) leaves the Python handler alone to hear of SIGTERM, so it acts too, once
between the two: otherwise the child ignored SIGTERM, and Pool.terminate() waited for ever.
"""
import ctypes
import os
import signal
import threading

_installed: tuple[int, int] | None = None   # this process's wakeup pipe (read end, write end)
_shut_down = None                            # what ends the tracers, given to install()
_ending = threading.Lock()                   # taken by whichever of the two acts on SIGTERM


def _noted(signum, frame) -> None:
    """SIGTERM's Python handler, which runs once the main thread runs Python again: the
    watching thread has heard of SIGTERM through the wakeup fd, unless the program took that
    since; so it is told here too (it acts once)."""
    if _installed is not None:
        try:
            os.write(_installed[1], bytes([signal.SIGTERM]))
        except OSError:   # full: the thread has SIGTERMs to read already
            pass


def _end() -> None:
    """Shut the tracers down and end the process by SIGTERM, once."""
    if not _ending.acquire(blocking=False):
        return
    try:
        _shut_down()
    finally:
        _terminate()


def install(shut_down) -> None:
    """In a multiprocessing child, on its main thread: SIGTERM calls `shut_down()` (bounded
    by itself) on a thread of its own, then ends the process by SIGTERM."""
    global _installed, _shut_down
    if _installed is not None or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:   # not the main thread
        previous = None
    if previous != -1:   # the program's (asyncio's) wakeup fd, or none could be set: SIGTERM stays as it is
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    _shut_down = shut_down
    signal.signal(signal.SIGTERM, _noted)
    _installed = read, write
    threading.Thread(target=_watch, args=(read,), name="crosstrace-sigterm", daemon=True).start()


def _watch(read: int) -> None:
    while True:
        try:
            received = os.read(read, 64)
        except OSError:   # closed (a fork's child, see forget_after_fork)
            return
        if not received:
            return
        if signal.SIGTERM in received and signal.getsignal(signal.SIGTERM) is _noted:   # not taken over since
            _end()


def _terminate() -> None:
    """End this process by SIGTERM's default action (signal.signal is for the main thread
    only, which may be stuck in C: libc's signal() is called directly)."""
    ctypes.CDLL(None).signal(signal.SIGTERM, ctypes.c_void_p(int(signal.SIG_DFL)))
    os.kill(os.getpid(), signal.SIGTERM)


def forget_after_fork() -> None:
    """In any forked child: the parent's pipe and SIGTERM handler go (its thread did not
    come along, and SIGTERM would be noted and ignored); a multiprocessing child installs
    its own."""
    global _installed, _ending
    if _installed is None:
        return
    _ending = threading.Lock()   # (the parent may have been ending when it forked)
    read, write = _installed
    _installed = None
    previous = signal.set_wakeup_fd(-1)
    if previous != write:   # the program's since: left to it
        signal.set_wakeup_fd(previous)
    if signal.getsignal(signal.SIGTERM) is _noted:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.close(read)
    os.close(write)
