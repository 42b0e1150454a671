"""Child side of the code-execution reward: confine this process, then run untrusted code.

Run as `python -I sandbox_runner.py BOX_DIR LIMITS_JSON` by `rollart.rewards.code_exec`, with
stdin/stdout/stderr already redirected to files. Stdlib only. The order matters:

1. read the solution (and test code) while we still may;
2. resource limits, soft == hard so the code cannot raise them again: address space, CPU
   seconds, file size, open files, no new processes or threads, no core dumps;
3. namespaces: a private network namespace (only a down loopback: no TCP, UDP or abstract unix
   socket reaches anything) and a private mount namespace in which BOX_DIR becomes a tmpfs of
   at most `disk_bytes` and `max_files` inodes (a disk fill stops there, not at the host's disk);
   as non-root through a user namespace, whose capabilities are dropped right after;
4. as root: pre-import common stdlib modules, then become `nobody` (root could raise limits back,
   and the interpreter may live where `nobody` cannot read, e.g. /root/.pyenv);
5. die with the caller: PR_SET_PDEATHSIG=SIGKILL (set after the uid change, which clears it), so
   a handler killed on a Lambda timeout takes its sandbox with it;
6. Landlock (Linux >= 5.13, unprivileged): writes only beneath BOX_DIR, reads only beneath the
   Python installation and system library dirs, no TCP, no signals to processes outside the
   sandbox (so not to the caller), when the kernel's ABI has those;
7. an audit hook that refuses the same things in Python (a second layer, bypassable on its own).

Fail closed: when a layer the kernel must provide is missing (Landlock, the namespaces and
tmpfs, signal scoping or a different uid), nothing runs: exit EXIT_UNCONFINED with a message
naming what is missing, unless the operator allowed a weaker sandbox (`allow_weak`).

Modes (`mode` in LIMITS_JSON):
- "main": run solution.py as a program (stdin -> stdout tests);
- "serve" / "tests" (asserts mode): the solution and the tests run in two sandboxes joined by
  two pipes (LIMITS_JSON "fds": read, write). "serve" runs the solution's top level, announces
  its top-level functions, classes and literal constants, then answers calls: arguments and
  results cross as `repr` text that the other side reads with `ast.literal_eval`, anything
  else as an opaque handle. "tests" runs tests.py with proxies of those names; its exit status
  and the completion marker (read from its stdin, which the solution's process never sees) are
  the verdict. So a solution cannot read the marker from the tests' frames, cannot hand the
  tests an object whose `__eq__` is always true (they only ever hold literals or handles), and
  cannot shadow the tests' builtins.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import os
import resource
import sys

NOBODY = 65534
EXIT_UNCONFINED = 97  # the caller raises SandboxUnavailable: an infrastructure error, not a score
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_SET_PDEATHSIG = 1
PRELOAD = ("math", "cmath", "re", "json", "collections", "itertools", "functools", "heapq",
           "bisect", "string", "random", "fractions", "decimal", "statistics", "typing",
           "dataclasses", "operator", "copy", "array", "datetime", "textwrap", "unicodedata",
           "io", "time", "struct", "hashlib", "enum", "abc", "numbers", "traceback", "ast")
# Landlock constants (include/uapi/linux/landlock.h).
SYS_CREATE, SYS_ADD_RULE, SYS_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)
NET_ALL, SCOPE_ALL = (1 << 0) | (1 << 1), (1 << 0) | (1 << 1)
BLOCKED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                  "os.fork", "os.forkpty", "os.kill", "os.killpg", "socket.__new__",
                  "socket.connect", "socket.bind", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.cdata")
PATH_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown",
               "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def set_limits(lim: dict) -> None:
    mem = int(lim["memory_mb"]) * 1024 * 1024
    cpu = int(lim["cpu_s"])
    for res, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, int(lim["fsize_bytes"])),
                     (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, 0),
                     (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (val, val))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def isolate(box: str, lim: dict) -> str | None:
    """Private network and mount namespaces, BOX_DIR as a size-capped tmpfs. Returns what
    failed (None when all of it holds)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        return f"network/mount namespaces (unshare: {os.strerror(ctypes.get_errno())})"
    try:
        if not root:  # map ourselves to ourselves: files stay ours, no other id exists
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as err:
        return f"user namespace id map ({err.strerror})"
    # mounts below must not propagate back to the host's namespace
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"private mounts ({os.strerror(ctypes.get_errno())})"
    owner = f",uid={NOBODY},gid={NOBODY}" if root else ""
    opts = (f"size={int(lim['disk_bytes'])},nr_inodes={int(lim['max_files'])},mode=0700"
            f"{owner}").encode()
    if libc.mount(b"tmpfs", box.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        return f"tmpfs quota on the sandbox dir ({os.strerror(ctypes.get_errno())})"
    os.chdir(box)  # the old cwd is the directory underneath the mount
    if not root:  # the user namespace gave us every capability in it: give them back
        hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
        if libc.capset(ctypes.byref(hdr), data) != 0:
            return f"dropping capabilities ({os.strerror(ctypes.get_errno())})"
    return None


def die_with_parent(parent: int) -> bool:
    """SIGKILL when the caller dies (and check it has not died already)."""
    if _libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
        return False
    return os.getppid() == parent


def drop_root(box: str, extra: tuple[str, ...] = ()) -> None:
    if os.geteuid() != 0:
        return
    for name in PRELOAD + extra:  # the interpreter's files may be unreadable once we are nobody
        __import__(name)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def read_roots(box: str) -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/lib", "/lib64", "/bin",
             box}
    return sorted(os.path.realpath(r) for r in roots if os.path.isdir(r))


def landlock(box: str) -> int:
    """Returns the Landlock ABI applied (0: not available, the audit hook stands alone)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(SYS_CREATE, None, 0, 1)
        if abi < 1:
            return 0
        fs = (1 << 13) - 1  # ABI 1: execute .. make_sym
        fs |= (1 << 13) if abi >= 2 else 0  # refer
        fs |= (1 << 14) if abi >= 3 else 0  # truncate
        fs |= (1 << 15) if abi >= 5 else 0  # ioctl_dev
        attr = _RulesetAttr(fs, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
        rs = libc.syscall(SYS_CREATE, ctypes.byref(attr), ctypes.sizeof(attr), 0)
        if rs < 0:
            return 0
        rules = [(r, FS_READ) for r in read_roots(box) if r != box] + [(box, fs)]
        rules += [(d, FS_READ_FILE | FS_WRITE_FILE) for d in ("/dev/null", "/dev/zero")]
        rules += [("/dev/urandom", FS_READ_FILE)]
        for path, allowed in rules:
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            if not os.path.isdir(path):
                allowed &= FILE_RIGHTS & fs
            rule = _PathBeneath(allowed & fs, fd)
            libc.syscall(SYS_ADD_RULE, rs, 1, ctypes.byref(rule), 0)
            os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(SYS_RESTRICT, rs, 0) != 0:
            return 0
        os.close(rs)
        return abi
    except (OSError, AttributeError):
        return 0


def audit_hook(box: str):
    roots = tuple(read_roots(box)) + ("/dev/null", "/dev/zero", "/dev/urandom")
    box_real = os.path.realpath(box)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def under(path: object, allowed: tuple[str, ...]) -> bool:
        if isinstance(path, int) or path is None:
            return True
        real = os.path.realpath(os.fsdecode(path))
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in allowed)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
            if not under(path, (box_real,) if writing else roots):
                kind = "write" if writing else "read"
                raise PermissionError(f"sandbox: {kind} outside the sandbox: {path}")
        elif event in PATH_EVENTS:
            for p in args[:2]:
                if isinstance(p, str | bytes | os.PathLike) and not under(p, (box_real,)):
                    raise PermissionError(f"sandbox: {event} outside the sandbox: {p}")
        elif event.startswith(BLOCKED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")

    return hook


def confine(box: str, lim: dict) -> list[str]:
    """Steps 3-6 of the module docstring. Returns what is missing (empty: fully confined).
    `lim["without"]` skips layers, for the tests that show each one is needed."""
    skip = set(lim.get("without", ()))
    missing = []
    was_root = os.geteuid() == 0
    if "namespaces" in skip:
        missing.append("network/mount namespaces (skipped)")
    elif (why := isolate(box, lim)) is not None:
        missing.append(why)
    # `preload`: tests give the code modules (socket) that a world-readable Python would let it
    # import as nobody, to show that the kernel layers hold without the import failing
    drop_root(box, tuple(lim.get("preload", ())))
    if not die_with_parent(int(lim["parent"])):
        os._exit(EXIT_UNCONFINED)  # the caller is gone already: nobody wants the result
    abi = 0 if "landlock" in skip else landlock(box)
    if abi < 1:
        missing.append("Landlock (Linux >= 5.13 with landlock in the LSM list)")
    if abi < 6 and not was_root:  # as root we are nobody now: the kernel refuses the signals
        missing.append("Landlock ABI 6 signal scoping (Linux >= 6.12)")
    return missing


def _send(fd: int, msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:  # a pipe may take a large message in parts
        data = data[os.write(fd, data):]


def _lines(fd: int):
    with os.fdopen(fd, "rb", buffering=0) as f:
        for raw in iter(f.readline, b""):
            yield json.loads(raw)


MAX_REPR = 1 << 20


def _encode(value: object, handles: list) -> dict:
    try:
        text = repr(value)
        if len(text) <= MAX_REPR:
            ast.literal_eval(text)
            return {"value": text}
    except Exception:  # noqa: BLE001 - not a literal: pass a handle
        pass
    handles.append(value)
    return {"handle": len(handles) - 1}


def serve(scope: dict, fds: list[int]) -> None:
    """Answer the tests' calls on the solution's top-level names."""
    rfd, wfd = fds
    names = {}
    for k, v in scope.items():
        if k.startswith("__") or type(v).__name__ == "module":
            continue
        enc = _encode(v, [])
        names[k] = enc["value"] if "value" in enc else None  # None: callable, via calls
    _send(wfd, {"names": names})
    handles: list = []

    def decode(a: dict) -> object:
        return handles[a["handle"]] if "handle" in a else ast.literal_eval(a["value"])

    for msg in _lines(rfd):
        try:
            obj = scope[msg["name"]] if "name" in msg else handles[msg["handle"]]
            if msg["op"] == "getattr":
                out = getattr(obj, msg["attr"])
            else:
                out = obj(*[decode(a) for a in msg["args"]],
                          **{k: decode(a) for k, a in msg["kwargs"].items()})
            _send(wfd, _encode(out, handles))
        except Exception as err:  # noqa: BLE001 - the solution's error goes to the tests
            _send(wfd, {"error": type(err).__name__, "message": str(err)[:2000]})


def run_tests(tests: str, fds: list[int]) -> None:
    """tests.py against proxies of the solution's names; only literals come back."""
    rfd, wfd = fds
    answers = _lines(rfd)
    first = next(answers, None)
    if not first or not isinstance(first.get("names"), dict):
        sys.exit("sandbox: the solution ended before its functions could be tested")

    def rpc(msg: dict) -> object:
        _send(wfd, msg)
        got = next(answers, None)
        if got is None:
            raise RuntimeError("the solution's process ended")
        if "error" in got:
            exc = getattr(builtins, str(got["error"]), None)
            if not (isinstance(exc, type) and issubclass(exc, Exception)):
                exc = RuntimeError
            raise exc(str(got.get("message", "")))
        return Remote({"handle": int(got["handle"])}) if "handle" in got else \
            ast.literal_eval(str(got["value"]))

    def arg(a: object) -> dict:
        return dict(a._ref) if isinstance(a, Remote) else {"value": repr(a)}

    class Remote:
        def __init__(self, ref: dict) -> None:
            object.__setattr__(self, "_ref", ref)

        def __call__(self, *args, **kwargs):
            return rpc({"op": "call", **self._ref, "args": [arg(a) for a in args],
                        "kwargs": {k: arg(v) for k, v in kwargs.items()}})

        def __getattr__(self, attr: str):
            return rpc({"op": "getattr", **self._ref, "attr": attr})

    scope: dict = {"__name__": "__main__", "__builtins__": builtins}
    for name, value in first["names"].items():
        if hasattr(builtins, name):  # the solution does not get to redefine `len` for the tests
            continue
        scope[name] = Remote({"name": name}) if value is None else ast.literal_eval(value)
    exec(compile(tests, "tests.py", "exec"), scope)


def main() -> None:
    box, lim = sys.argv[1], json.loads(sys.argv[2])
    mode = lim.get("mode", "main")
    os.chdir(box)
    name = "tests.py" if mode == "tests" else "solution.py"
    with open(os.path.join(box, name), encoding="utf-8") as f:
        source = f.read()
    marker = sys.stdin.readline().strip() if mode == "tests" else ""
    set_limits(lim)
    missing = confine(box, lim)
    if missing and not lim.get("allow_weak"):
        sys.stderr.write("sandbox: refusing to run untrusted code: this kernel cannot confine "
                         "it: missing " + "; ".join(missing) + "\n")
        sys.stderr.flush()
        os._exit(EXIT_UNCONFINED)
    if "audit" not in set(lim.get("without", ())):
        sys.addaudithook(audit_hook(box))
    for mod in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
        del sys.modules[mod]  # a re-import needs dlopen, which the hook refuses
    sys.argv = [name]
    sys.path[:] = [p for p in sys.path if p.startswith(tuple(read_roots(box)))]
    if mode == "tests":
        run_tests(source, lim["fds"])
        sys.stdout.write("\n" + marker + "\n")
        sys.stdout.flush()
        return
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    code = compile(source, name, "exec")
    source = ""
    exec(code, scope)
    if mode == "serve":
        serve(scope, lim["fds"])


if __name__ == "__main__":
    main()
