"""The C API of libdos.so (capi/ in the Go repository) through ctypes.

The library is found beside this file, or at $DOS_LIB. Every call that can fail returns its Go
error message, raised here as DosError.
"""
import ctypes
import os
import threading

__all__ = ["DosError", "REDUCE_FN", "library_path", "lib", "call"]


class DosError(RuntimeError):
    """An error from dos's Go runtime; the message is Go's."""


def library_path():
    """Where libdos.so is loaded from: $DOS_LIB, or beside this package."""
    return os.environ.get("DOS_LIB") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "libdos.so")


_lib = None
_lib_pid = None  # the process that loaded _lib: dos's Go runtime does not survive fork()

# dos_reduce_fn (capi/capi.go): combines this rank's gradient sum of squares with the other ranks', in place;
# returns 0, or nonzero when it failed.
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.POINTER(ctypes.c_double))

# The exported functions and their C signatures (capi/capi.go); test_native checks them against the
# library's header.
SIGNATURES = {
    "dos_version": (ctypes.c_char_p, []),
    "dos_lock_fds": (ctypes.c_int32, [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "dos_fork_prepare": (ctypes.c_int32, [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "dos_fork_done": (None, []),
    "dos_free": (None, [ctypes.c_void_p]),
    "dos_adamw_new": (ctypes.c_int64, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_step": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double), ctypes.c_int32,
                                        ctypes.c_double, REDUCE_FN, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_device_ptrs": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64),
                                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_step_device": (ctypes.c_int32, [ctypes.c_int64, ctypes.POINTER(ctypes.c_double), ctypes.c_int32, ctypes.c_double,
                                               REDUCE_FN, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_state_get": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_state_set": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_get_step": (ctypes.c_int64, [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_set_step": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_save": (ctypes.c_int64, [ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32,
                                        ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]),
    "dos_save_done": (ctypes.c_int32, [ctypes.c_int64]),
    "dos_save_wait": (ctypes.c_int32, [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]),
    "dos_save_free": (None, [ctypes.c_int64]),
    "dos_adamw_load": (ctypes.c_int32, [ctypes.c_int64, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_placement": (ctypes.c_int32, [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]),
    "dos_adamw_close": (ctypes.c_int32, [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]),
}


def forked():
    """Whether this is a fork()ed child of the process that loaded the library, where no call into dos can run
    (check_process refuses them; a close there only forgets its handle)."""
    return _lib_pid is not None and os.getpid() != _lib_pid


def check_process():
    """Refuses (DosError) a call into dos from a process other than the one that loaded its library: dos's Go
    runtime does not survive fork() (the child has only the forking thread, so a call that waits on a goroutine,
    a save's, a step's workers', would hang for ever), whatever object the call is about."""
    if forked():
        raise DosError(f"dos: its library was loaded in process {_lib_pid}, and this is process {os.getpid()} (a fork()ed "
                       "child): dos's Go runtime does not survive fork(), so no call into dos can run here; start such "
                       "processes with the spawn start method (multiprocessing.set_start_method(\"spawn\"), or a "
                       "DataLoader's multiprocessing_context=\"spawn\"), and use dos in the parent or in spawned processes")


def lib():
    """The loaded library (loaded once). Raises DosError when it is missing, or in a fork()ed child of the process
    that loaded it (check_process)."""
    global _lib, _lib_pid
    check_process()
    if _lib is None:
        path = library_path()
        if not os.path.exists(path):
            raise DosError(f"dos: {path} is missing: build it with `make python` (or set DOS_LIB)")
        l = ctypes.CDLL(path)
        for name, (res, args) in SIGNATURES.items():
            f = getattr(l, name)
            f.restype, f.argtypes = res, args
        _lib, _lib_pid = l, os.getpid()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
    return _lib


_fork_fds = []  # the root locks' descriptors as a fork() began (_before_fork)
_fork_held = False  # whether _before_fork holds dos's lock files still (dos_fork_prepare)


def _before_fork():
    """In the forking process: the descriptors of the checkpoint roots' locks it holds, with every open and
    close of a lock file held off until the fork is done (dos_fork_prepare; _after_fork_in_parent ends it):
    another thread's save or close between this and fork() would leave the child a lock it then pins, or
    have it close a reused descriptor number."""
    global _fork_fds, _fork_held
    _fork_fds = []
    if _lib is None or os.getpid() != _lib_pid:
        return
    buf = (ctypes.c_int32 * 256)()
    k = _lib.dos_fork_prepare(buf, 256)
    _fork_held = True
    _fork_fds = list(buf[:min(k, 256)])


def _after_fork_in_parent():
    """In the forking process, after fork() (or its failure): lock files may be opened and closed again."""
    global _fork_held
    if _fork_held:
        _fork_held = False
        _lib.dos_fork_done()


def _after_fork_in_child():
    """In a fork()ed child: those descriptors closed. An flock(2) lock belongs to the open file, which the child
    shares: a child that never writes a root (a DataLoader worker) kept it locked after the parent released it.
    dos's hold on its lock files (dos_fork_prepare) is the parent's: the child never calls into dos."""
    global _fork_held
    _fork_held = False
    for fd in _fork_fds:
        try:
            os.close(fd)
        except OSError:
            pass


def take_string(ptr):
    """The C string at ptr (a c_void_p the library malloc'd), freed; None for NULL."""
    if not ptr.value:
        return None
    s = ctypes.string_at(ptr.value).decode("utf-8", "replace")
    lib().dos_free(ptr)
    return s


def take_bytes(ptr):
    """The bytes of the C string at ptr (a c_void_p the library malloc'd), freed; None for NULL. For paths:
    os.fsdecode turns them into the str that os's functions take back (a non-UTF-8 name included)."""
    if not ptr.value:
        return None
    b = ctypes.string_at(ptr.value)
    lib().dos_free(ptr)
    return b


def call(name, *args):
    """Calls a function whose last argument is char **err; raises DosError with Go's message when it
    fails (every failure of the C API sets *err: capi's run)."""
    err = ctypes.c_void_p()
    f = getattr(lib(), name)
    r = f(*args, ctypes.byref(err))
    if err.value:
        msg = ctypes.string_at(err.value).decode("utf-8", "replace")
        lib().dos_free(err)
        raise DosError(msg)
    return r
