"""The program run inside the code sandbox (standard library only; started with ``python -I``).

It reads a JSON job from stdin, then, before any untrusted code runs:

1. (namespace mode) makes every mount read-only except its working directory, then enters a
   fresh user namespace so that it holds no capability over those mounts and cannot undo that;
2. installs an audit hook (PEP 578) that refuses process creation, signals, sockets, ctypes,
   introspection of the harness (gc), and file writes, renames and deletes outside the working
   directory.

It then executes the program and each test in a fresh namespace, printing ``<nonce> PASS i``
after each passing test and ``<nonce> DONE`` at the end, so that a run killed at its deadline
still reports the tests that passed before it.
"""

import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME = 32, 4096, 1024, 2048
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
CLONE_NEWUSER = 0x10000000
_OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


def _unescape(path):
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            yield _unescape(parts[4]), parts[5].split(",")


def lock_down_filesystem(workdir):
    """Read-only view of every mount but ``workdir``, then drop capabilities via a new user ns."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "bind-mounting the working directory failed")
    os.chdir(workdir)  # the old cwd still points into the mount below, which becomes read-only
    for point, opts in sorted(_mounts(), key=lambda m: -len(m[0])):
        if point == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts:
            flags |= _OPT_FLAGS.get(opt, 0)
        if libc.mount(None, point.encode(), None, flags, None) != 0 and "ro" not in opts:
            err = ctypes.get_errno()
            # A mount hidden under another one cannot be reached by path: nothing to protect.
            if os.path.ismount(point) and err not in (2, 22):  # ENOENT, EINVAL
                raise OSError(err, f"cannot make {point} read-only")
    if libc.unshare(CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) failed")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_BLOCKED = {"os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
            "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata",
            "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.addaudithook", "os.chroot",
            "os.setuid", "resource.setrlimit", "resource.prlimit", "mmap.__new__"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.chdir"}


def install_audit_hook(workdir):
    root = os.path.realpath(workdir)

    def inside(path):
        if isinstance(path, int):
            return True  # an already-open descriptor
        try:
            real = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return real == root or real.startswith(root + os.sep)

    def hook(event, args):
        if event in _BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
            raise PermissionError("sandbox: ctypes is not allowed")
        if event == "open" and len(args) > 2 and isinstance(args[2], int) and args[2] & _WRITE_FLAGS:
            if not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory")
        if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            if not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory")
        if event in _PATH_EVENTS and args and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
            raise PermissionError(f"sandbox: {event} outside the working directory")

    sys.addaudithook(hook)


def main():
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce, workdir = job["nonce"], os.getcwd()
    out = sys.stdout
    if job.get("lockdown"):
        lock_down_filesystem(workdir)
    # Modules commonly imported by tests, loaded before the hook so their import machinery is not
    # blocked (typing reads caller frames).
    import collections, functools, hashlib, itertools, math, random, re, string, typing  # noqa: F401,E401
    if job.get("audit_hook", True):  # off only in tests of the kernel-level layer alone
        install_audit_hook(workdir)
    program, setup, tests = job["program"], job.get("setup", ""), job["tests"]
    del job
    print(f"{nonce} START", file=out, flush=True)
    scope = {"__name__": "__main__"}
    try:
        exec(compile(program, "<program>", "exec"), scope)
        if setup:
            exec(compile(setup, "<setup>", "exec"), scope)
    except BaseException as exc:  # noqa: BLE001 - the program's failure is the result
        # The exception as an interpreter's last traceback line (the python tool shows it to the model).
        try:
            line = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except BaseException:  # noqa: BLE001 - a program's exception whose __str__ fails
            line = type(exc).__name__
        print(line, file=sys.stderr, flush=True)
        print(f"{nonce} ERROR {type(exc).__name__}", file=out, flush=True)
        os._exit(0)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), dict(scope))
        except BaseException:  # noqa: BLE001, S112 - a failing test scores 0
            continue
        print(f"{nonce} PASS {i}", file=out, flush=True)
    print(f"{nonce} DONE", file=out, flush=True)
    os._exit(0)  # no atexit handlers or buffered output from the program


if __name__ == "__main__":
    main()
