"""The code that runs inside `builtin:code`'s sandbox process (stdlib only; the parent passes this file's text to
``python -I -S -c``, so it never imports rlhfkit and sees no site-packages).

``argv``: ``[plan_fd, result_fd]``. The plan (JSON, read from ``plan_fd``) holds the program, the steps to run after
it and the limits; nothing in it is an expected value. The process tree:

* the *supervisor* (this process; the parent's process-group leader) marks itself a child subreaper (orphans of
  the program come back to it, so the parent can find and kill them), starts the *program process* and, when that
  ends, writes ``{"done": <exit status>}`` to the result pipe and waits to be killed;
* in ``namespaces`` mode the program process first enters new user, mount, network, pid, IPC and UTS namespaces
  (``unshare(2)``; the supervisor writes its uid/gid maps), forks the namespace's pid 1 (which dies with its
  parent: ``PR_SET_PDEATHSIG``; when pid 1 dies the kernel kills every process of the namespace), and that builds
  a fresh root (a size-capped tmpfs with read-only binds of /usr, the Python installation and a few /dev nodes, a
  private /proc and an empty writable /tmp), ``pivot_root``s into it, detaches the old root and forks the program
  with no capabilities (an unprivileged uid where the parent runs as root);
* the program process sets the rlimits, runs the program as ``__main__`` and then each step: ``exec`` steps (the
  test's setup statements) and ``eval`` steps (the test's assert operands), writing each value to the result pipe as
  type-tagged JSON (``["int", 3]``, ``["list", [...]]``; exact built-in types only: a subclass or any other object
  is reported ``unserialisable``). The parent compares them with the expected values, which never reach here.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
SYS_PIVOT_ROOT = 155  # x86_64 and aarch64 differ; resolved below
PROGRAM_UID = 1000     # the program's uid inside the namespace when the parent runs as root (mapped to nobody)
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def _pivot_root(new_root, put_old):
    number = {"x86_64": 155, "aarch64": 41, "ppc64le": 203}.get(os.uname().machine, SYS_PIVOT_ROOT)
    _check(_libc.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def _write(fd, message):
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


# ---- values -> type-tagged JSON (exact built-in types only)

def encode(value, depth=0):
    if depth > 100:
        raise ValueError("nested too deep")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return [kind.__name__, value]
    if kind is int:
        return ["int", str(value)]
    if kind is float:
        return ["float", float.hex(value)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return [kind.__name__, [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"a {kind.__name__} is not plain data")


# ---- the program process

def set_limits(limits):
    for name, value in limits.items():
        key = getattr(resource, name)
        try:
            resource.setrlimit(key, (value, value))
        except (ValueError, OSError):  # above the current hard limit: keep the lower one there is
            resource.setrlimit(key, (min(value, resource.getrlimit(key)[1]),) * 2)


def run_program(plan, result_fd):
    set_limits(plan["limits"])
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(plan["program"], "<program>", "exec"), namespace)
    except SystemExit as err:  # exiting is no failure of a stdin/stdout case, but the tests after it never ran
        _write(result_fd, {"program": "SystemExit"})
        _exit(err.code if err.code is None or type(err.code) is int else 1)
    except BaseException as err:  # noqa: BLE001 - the program's own failure fails its tests
        _write(result_fd, {"program": type(err).__name__})
        _exit(1)
    _write(result_fd, {"program": "ok"})
    for index, step in enumerate(plan["steps"]):
        try:
            if "exec" in step:
                exec(compile(step["exec"], "<test>", "exec"), namespace)
                message = {"step": index, "ok": True}
            else:
                message = {"step": index, "ok": True, "value": encode(eval(compile(step["eval"], "<test>", "eval"),
                                                                            namespace))}
        except (TypeError, ValueError, RecursionError) as err:
            message = {"step": index, "ok": False, "error": type(err).__name__}
        except BaseException as err:  # noqa: BLE001 - the step's exception is its result
            message = {"step": index, "ok": False, "error": type(err).__name__}
        try:
            _write(result_fd, message)
        except (TypeError, ValueError):
            _write(result_fd, {"step": index, "ok": False, "error": "unserialisable"})
    _exit(0)


def _exit(code):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or replaced stream: nothing more to write
            pass
    os._exit(code or 0)


# ---- namespaces

def _bind(source, target, *, directory):
    if directory:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    stat = os.statvfs(target)  # a remount in a user namespace must keep the locked flags of the original mount
    flags |= MS_NODEV if stat.f_flag & os.ST_NODEV else 0
    flags |= MS_NOEXEC if stat.f_flag & os.ST_NOEXEC else 0
    _mount(None, target, None, flags)


def build_root(plan):
    """The namespace's filesystem: a fresh tmpfs root holding read-only binds of what Python needs."""
    root = "/tmp"  # mounted over in this private mount namespace only
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={plan['tmpfs_bytes']},mode=0755")
    for path in plan["ro_dirs"]:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(path, root + path, directory=True)
    for device in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"):
        _bind(device, root + device, directory=False)
    for name, mode in (("proc", 0o555), ("tmp", 0o1777), ("oldroot", 0o700)):
        os.makedirs(f"{root}/{name}", exist_ok=True)
        os.chmod(f"{root}/{name}", mode)
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={plan['tmpfs_bytes']},mode=1777")
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # a container that masks parts of /proc forbids a fresh one: go without
        pass
    os.chdir(root)
    _pivot_root(".", "oldroot")
    os.chdir("/")
    _check(_libc.umount2(b"/oldroot", MNT_DETACH), "umount oldroot")
    os.rmdir("/oldroot")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/tmp")


def drop_privileges(as_root_outside):
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if as_root_outside:
        os.setgroups([])
        os.setresgid(PROGRAM_UID, PROGRAM_UID, PROGRAM_UID)
        os.setresuid(PROGRAM_UID, PROGRAM_UID, PROGRAM_UID)  # leaves no capability
    else:
        for cap in range(64):
            _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)

        class _Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class _Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]

        _check(_libc.capset(ctypes.byref(_Header(0x20080522, 0)), ctypes.byref((_Data * 2)())), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _die_with_parent(parent):
    """SIGKILL this process when its parent dies (``parent`` None: the parent is outside our pid namespace, where
    getppid() says 0, so an already dead one cannot be seen; the parent's kill of the whole tree covers that)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _wait_status(pid):
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def namespaced_program(plan, result_fd, ready_w, maps_r):
    """In the program process: enter the namespaces, then fork pid 1, which builds the root and runs the program."""
    _die_with_parent(plan["supervisor"])
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare")
    os.write(ready_w, b"u")
    if os.read(maps_r, 1) != b"m":
        os._exit(1)
    init = os.fork()
    if init:
        os._exit(max(0, _wait_status(init)))
    _die_with_parent(None)
    build_root(plan)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    program = os.fork()
    if program == 0:
        drop_privileges(plan["as_root_outside"])
        run_program(plan, result_fd)
    os._exit(max(0, _wait_status(program)))  # pid 1: when it returns, the kernel kills the rest of the namespace


def write_maps(pid, as_root_outside):
    uid, gid = os.geteuid(), os.getegid()
    if as_root_outside:  # namespace root = real root (to set the view up), the program's uid = nobody
        uid_map, gid_map = f"0 0 1\n{PROGRAM_UID} {NOBODY} 1\n", f"0 0 1\n{PROGRAM_UID} {NOBODY} 1\n"
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        uid_map, gid_map = f"0 {uid} 1\n", f"0 {gid} 1\n"
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def supervise(plan_fd, result_fd):
    with os.fdopen(plan_fd, "rb") as f:
        plan = json.loads(f.read())
    plan["supervisor"] = os.getpid()
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if plan["mode"] == "namespaces":
        ready_r, ready_w = os.pipe()
        maps_r, maps_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(maps_w)
            namespaced_program(plan, result_fd, ready_w, maps_r)
        os.close(ready_w)
        os.close(maps_r)
        if os.read(ready_r, 1) == b"u":
            try:
                write_maps(pid, plan["as_root_outside"])
                os.write(maps_w, b"m")
            except OSError as err:
                _write(result_fd, {"sandbox": f"uid map: {err}"})
        os.close(maps_w)
    else:
        pid = os.fork()
        if pid == 0:
            run_program(plan, result_fd)
    status = _wait_status(pid)
    _write(result_fd, {"done": status})
    while True:  # stay the subreaper of what the program left behind until the parent kills the group
        signal.pause()


if __name__ == "__main__":
    supervise(int(sys.argv[1]), int(sys.argv[2]))
