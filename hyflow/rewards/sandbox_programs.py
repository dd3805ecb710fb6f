"""The programs `hyflow.rewards.sandbox` runs inside its sandbox (see that module's docstring for what each
stage does and why): the prelude (the supervisor, the init of the PID namespace and the solution process, in one
program) and the guarantee probe. Plain text, compiled or run by `run_code`; nothing here runs in hyflow's own
process."""

MEMORY_ERROR_EXIT_CODE = 201
"""Exit code the prelude uses for an uncaught MemoryError (checked together with 'MemoryError' in stderr)."""

DEADLINE_EXIT_CODE = 202
"""Exit code of the supervisor when it killed the solution at the wall-clock limit (a solution that exits with
it is reported as a timeout: a failure either way)."""

# The supervisor (S0), the init of the PID namespace and the solution process, in one program, compiled once
# per hyflow process into a .pyc that `python -I -S` runs (compiling it on every call cost ~5 ms). argv[1] is
# the settings dict as a Python literal (json's import costs more than the rest of the start-up). Only
# built-in/stdlib modules are imported (python -S); the protections each stage applied are written, one per
# line, to the report pipe.
PRELUDE = r'''
import builtins, ctypes, os, resource, signal, struct, sys, time, types, _posixsubprocess, _socket

_C = eval(sys.argv[1], {"__builtins__": {}})  # a literal written by run_code
_LIBC = ctypes.CDLL(None, use_errno=True)
_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
_ALL_NEW_NAMESPACES = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_MS_NOATIME, _MS_NODIRATIME, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 18, 1 << 21, 1 << 24
_REPORT = _C["report_fd"]
_LINUX = sys.platform.startswith("linux")  # elsewhere: rlimits, the wall clock and the Python guards only
# Real paths, resolved while the host's files are still in view: the sandbox binds the interpreter's directories
# back at their real paths, and a symlink on the way (a venv reached through a link under /tmp) is gone there.
sys.path[:] = [os.path.realpath(entry) for entry in sys.path]

def _report(*names):
    os.write(_REPORT, "".join(name + "\n" for name in names).encode())

def _call(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")

def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _call(_LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")

def _write_file(path, text):
    with open(path, "w") as file:
        file.write(text)

# ---- S0, the supervisor -----------------------------------------------------------------------------------

def _enter_namespaces():
    """New PID/net/mount/IPC namespaces (+ a user namespace when not root). False when the kernel refuses."""
    if "namespaces" in _C["disabled"] or not _LINUX:
        return False
    uid, gid = os.getuid(), os.getgid()
    flags = _NEWNS | _NEWPID | _NEWNET | _NEWIPC | (0 if uid == 0 else _NEWUSER)
    if _LIBC.unshare(flags) != 0:
        return False
    if uid != 0:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
        _report("user_namespace")
    _report("pid_namespace", "net_namespace")
    return True

def _scan_processes():
    """(pid, ppid, state, real uid) of every process (from /proc/PID/status: a process that changed its uid
    is not dumpable, and its /proc directory then belongs to root)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as file:
                fields = dict(line.split(b":", 1) for line in file.read().splitlines() if b":" in line)
            yield int(name), int(fields[b"PPid"]), fields[b"State"].split()[0], int(fields[b"Uid"].split()[0])
        except (OSError, KeyError, ValueError):
            continue

def _kill_leftovers(uid):
    """SIGKILL every descendant (they come back to us: we are a subreaper) and every process of `uid`."""
    if not _LINUX:
        return
    me = os.getpid()
    give_up = time.monotonic() + 2.0  # only a process stuck in the kernel (state D) could hold us longer
    while time.monotonic() < give_up:
        victims = [pid for pid, ppid, state, owner in _scan_processes()
                   if pid != me and (ppid == me or (uid is not None and owner == uid and state != b"Z"))]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in victims:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    while True:  # reap what is left
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break

def _stay_root():
    """Give the work directory back to root (run_code chowned it to the sandbox uid); returns no uid."""
    for path in (_C["workdir"], _C["solution"]):
        os.chown(path, 0, 0)
    return None

def _mirror(status):
    """Exit like the solution did: same exit code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

def _supervise():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    in_namespaces = _enter_namespaces()
    uid = _C["uid"]
    if uid is not None and _C["exposures"] and not in_namespaces:
        uid = _stay_root()  # the interpreter's directories cannot be re-exposed without a mount namespace
        _report("no separate_uid: the interpreter's directories are closed to other users and there is no "
                "mount namespace to re-expose them")
    if not in_namespaces and _LINUX:
        _call(_LIBC.prctl(36, 1, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")
        _report("subreaper")
    status_r, status_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    deadline = time.monotonic() + _C["timeout_s"]
    child = os.fork()
    if child == 0:
        os.close(status_r)
        if in_namespaces:
            uid = _init(uid, status_w)  # returns in the solution process only
        os.close(status_w)
        _solution(uid, userns=in_namespaces and not _C["root"])
        return
    os.close(status_w)
    status = None
    while status is None:
        pid, raw = os.waitpid(child, os.WNOHANG)
        if pid:
            status = raw
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        signal.sigtimedwait([signal.SIGCHLD], left)
    if status is None:  # past the wall clock: killing the init tears down its whole PID namespace
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    if not in_namespaces:
        _kill_leftovers(uid)
    if status is None:
        os._exit(DEADLINE_EXIT)
    if in_namespaces:
        reported = os.read(status_r, 64)
        if not reported:  # the init died without a word: its namespace is gone, report it as a crash
            os._exit(1)
        status = int(reported)
    _mirror(status)

# ---- the init (pid 1 of the new PID namespace) ------------------------------------------------------------

def _expose(exposures):
    """Replace each directory others may not search by a tmpfs and bind the needed paths back into it."""
    os.umask(0o022)
    for mask, paths in exposures:
        fds = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in paths]
        _mount("tmpfs", mask, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=64k")
        for path, fd in fds:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)

def _hide_files(paths):
    """Put /dev/null over each credential file (a bind mount: the file reads as empty, its name stays)."""
    for path in paths:
        _mount("/dev/null", path, None, _MS_BIND)

def _readonly_root():
    """Make every mount of this mount namespace read-only: mount_setattr(2) with AT_RECURSIVE (Linux 5.12+),
    else a read-only bind remount of each mount point, keeping its nosuid/nodev/noexec/atime flags (a user
    namespace may not clear those: they are locked)."""
    if "mount_setattr" not in _C["disabled"]:
        attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: attr_set = MOUNT_ATTR_RDONLY
        result = _LIBC.syscall(ctypes.c_long(442), ctypes.c_long(-100), b"/", ctypes.c_long(0x8000),
                               ctypes.byref(attr), ctypes.c_long(32))  # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE)
        if result == 0:
            return
        if ctypes.get_errno() not in (38, 22):  # ENOSYS, EINVAL: an older kernel, remount one by one
            _call(result, "mount_setattr /")
    with open("/proc/self/mountinfo", "rb") as file:
        points = [line.split()[4].decode("unicode_escape") for line in file]  # octal escapes (\040 = space)
    for point in points:
        try:
            flags = os.statvfs(point).f_flag
        except OSError:  # under a directory hidden by a tmpfs: unreachable from here
            continue
        if flags & os.ST_RDONLY:
            continue
        kept = flags & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
        kept |= _MS_RELATIME if flags & os.ST_RELATIME else 0 if flags & os.ST_NOATIME else _MS_STRICTATIME
        _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)

def _scratch(uid):
    """A fresh tmpfs on /tmp and /dev/shm (mode 1777) and a private working directory, each capped at
    `scratch_bytes` bytes and 4096 files, gone when the namespace ends."""
    options = f"size={_C['scratch_bytes']},nr_inodes=4096"
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    scratch = [path for path in ("/tmp", "/dev/shm") if os.path.isdir(path)]
    for path in scratch:
        # the interpreter may live there (a venv in a checkout under /tmp): keep its directories, read-only
        below = [p for p in _C["interpreter"] if p.startswith(path + "/")]
        kept = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in below
                if not any(p.startswith(q + "/") for q in below if q != p)]
        _mount("tmpfs", path, "tmpfs", flags, options + ",mode=1777")
        for inner, fd in kept:
            os.makedirs(inner, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", inner, None, _MS_BIND | _MS_REC)  # a bind keeps the read-only flag
            os.close(fd)
    workdir = _C["workdir"]
    if any(workdir.startswith(path + "/") for path in scratch):
        os.makedirs(workdir, mode=0o700)
    else:  # its mount point exists (the host directory, or one made in a hiding tmpfs before `/` became read-only)
        _mount("tmpfs", workdir, "tmpfs", flags, options + ",mode=700")
    if uid is not None:
        os.chown(workdir, uid, uid)

def _filesystem(uid):
    """The solution's view of the files: homes and credentials hidden, `/` read-only, private scratch space.

    Each step that held is reported; one that failed is reported with its error, and the call goes on with
    the weaker guarantee (the warning names it). Returns the uid to switch to (None: stay)."""
    with open(_C["solution"], "rb") as file:  # the host's work directory is about to be covered
        source = file.read()
    try:
        _expose(_C["masks"])
        _hide_files(_C["hidden_files"])
        _report("hidden_home")
    except OSError as error:
        _report("no hidden_home: " + str(error))
        if uid is not None and _C["exposures"]:  # the sandbox uid may not reach the interpreter
            _report("no separate_uid: " + str(error))
            uid = _stay_root()
    workdir = _C["workdir"]
    if not any(workdir.startswith(path + "/") for path in ("/tmp", "/dev/shm")):
        try:  # the mount point of the private working directory, while it can still be made
            os.makedirs(workdir, exist_ok=True)
        except OSError:
            pass
    try:
        _readonly_root()
        _report("readonly_root")
    except OSError as error:
        _report("no readonly_root: " + str(error))
    try:
        _scratch(uid)
        _report("private_scratch")
    except OSError as error:
        _report("no private_scratch: " + str(error))
    try:
        with open(_C["solution"], "wb") as file:
            file.write(source)
        if uid is not None:
            os.chown(_C["solution"], uid, uid)
    except OSError:  # no private working directory: the host's copy is still in place
        pass
    return uid

def _init(uid, status_w):
    """Pid 1 of the new PID namespace: a private /proc, the solution's file system view, then fork the
    solution and reap.

    Returns (the uid to switch to) in the forked solution process only; the init itself never returns."""
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here propagates to the host
        try:
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            _report("private_proc")
        except OSError as error:  # e.g. a user namespace inside a container that masks parts of /proc
            _report("no private_proc: " + str(error))
        if "filesystem" not in _C["disabled"]:
            uid = _filesystem(uid)
        elif uid is not None and _C["exposures"]:  # only what the sandbox uid needs to reach the interpreter
            try:
                _expose(_C["exposures"])
            except OSError as error:
                _report("no separate_uid: " + str(error))
                uid = _stay_root()
        child = os.fork()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    if child == 0:
        return uid
    try:
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                os.write(status_w, str(status).encode())
                break
    finally:
        os._exit(0)  # the kernel now kills whatever is left in the namespace

# ---- the solution process ---------------------------------------------------------------------------------

_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH, denied syscalls, socket, socketpair, clone, clone3)
    "x86_64": (0xC000003E, (101, 155, 161, 165, 166, 175, 176, 246, 248, 249, 250, 272, 298, 303, 304, 308, 310,
                            311, 312, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 438, 442),
               41, 53, 56, 435),
    "aarch64": (0xC00000B7, (39, 40, 41, 51, 97, 104, 105, 106, 117, 217, 218, 219, 241, 264, 265, 268, 270, 271,
                             273, 280, 282, 294, 425, 426, 427, 428, 429, 430, 431, 432, 433, 438, 442),
                198, 199, 220, 435),
}

def _seccomp_program():
    """Classic BPF: wrong arch -> kill; x32 -> ENOSYS; socket and the denied calls -> EPERM; clone3 -> ENOSYS;
    socketpair other than (AF_UNIX, SOCK_STREAM) -> EPERM; clone with a CLONE_NEW* flag -> EPERM; everything
    else allowed.

    A connected stream pair cannot reach anything else (connect: EISCONN; sendto with an address: EISCONN);
    a datagram or seqpacket pair can: sendto(path) or a second connect(path) deliver to any datagram socket
    the uid may write to, and no namespace stops that (a read-only mount does not guard socket files)."""
    arch, denied, socket_nr, socketpair_nr, clone_nr, clone3_nr = _SECCOMP_ARCH[os.uname().machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    and_ = 0x54  # BPF_ALU|BPF_AND|BPF_K
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    eperm, enosys = errno | 1, errno | 38
    af_unix, sock_stream, sock_flags = 1, 1, 0o4000 | 0o2000000  # SOCK_NONBLOCK | SOCK_CLOEXEC
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, enosys)]
    for nr in (socket_nr, *denied):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3_nr), (ret, 0, 0, enosys),
             (jeq, 0, 7, socketpair_nr),  # the 7 instructions below decide socketpair
             (ld, 0, 0, 16), (jeq, 0, 4, af_unix),  # args[0] (low 32 bits): the domain
             (ld, 0, 0, 24), (and_, 0, 0, ~sock_flags & 0xFFFFFFFF), (jeq, 0, 1, sock_stream),  # args[1]: type
             (ret, 0, 0, allow), (ret, 0, 0, eperm),
             (jeq, 0, 3, clone_nr), (ld, 0, 0, 16), (jset, 0, 1, _ALL_NEW_NAMESPACES), (ret, 0, 0, eperm),
             (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *op) for op in prog), len(prog)

def _install_seccomp():
    if not _LINUX:
        return False
    _call(_LIBC.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    if "seccomp" in _C["disabled"] or os.uname().machine not in _SECCOMP_ARCH:
        return False
    code, length = _seccomp_program()
    buffer = ctypes.create_string_buffer(code)
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = _Prog(length, ctypes.addressof(buffer))
    return _LIBC.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER

def _drop_capabilities():
    if not _LINUX:
        return
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _call(_LIBC.capset(header, data), "capset")

def _user_task_count(uid):
    if not _LINUX:
        return 1 << 20  # no /proc to count with: no fork limit (not reported as one)
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count

def _solution(uid, userns):
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    protections = []
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        protections += ["separate_uid", "fork_limit"]
        nproc = _C["max_processes"]
    elif os.getuid() != 0 and userns:
        _drop_capabilities()
        protections.append("fork_limit")
        nproc = _C["max_processes"] + 2  # the supervisor and the init share this user namespace's count
    elif os.getuid() != 0:
        protections += ["fork_limit"] if _LINUX else []
        nproc = _user_task_count(os.getuid()) + _C["max_processes"]
    else:  # root that could not switch uid: no capabilities at least (root is exempt from RLIMIT_NPROC)
        _drop_capabilities()
        nproc = _C["max_processes"]
    os.chdir(_C["workdir"])
    resource.setrlimit(resource.RLIMIT_AS, (_C["memory_bytes"], _C["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (_C["cpu_s"], _C["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_C["fsize"], _C["fsize"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if all(os.path.isdir(path) for path in _C["import_paths"]):
        protections.append("interpreter_visible")
    if _install_seccomp():
        protections.append("seccomp")
    _report(*protections)
    os.closerange(3, 1 << 16)  # the report pipe and anything else the supervisor held
    signal.alarm(_C["alarm_s"])  # one more self-destruct, in case both supervisors are gone
    _run_solution_code()

def _blocked(what):
    def deny(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the hyflow sandbox")
    return deny

class _NoNetworkSocket(_socket.socket):
    __slots__ = ()  # like its C base: socket.socket adds __weakref__ itself and fails if it exists
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None:  # wrapping an existing descriptor (socketpair(), which asyncio needs) stays allowed
            raise PermissionError("network access is disabled in the hyflow sandbox")
        super().__init__(family, type, proto, fileno)

def _run_solution_code():
    """Friendly Python-level guards, then the solution as a clean __main__ module."""
    sys.path.extend(_C["site_packages"])
    # `socket.socket` subclasses `_socket.socket` and copies `_socket`'s functions when first imported, so
    # patching `_socket` first makes every later `import socket` (urllib, http, asyncio...) inherit the block.
    _socket.socket = _socket.SocketType = _NoNetworkSocket
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        setattr(_socket, name, _blocked("network access"))
    stream_pair = _socket.socketpair
    def socketpair(family=_socket.AF_UNIX, type=_socket.SOCK_STREAM, proto=0):  # what seccomp lets through
        if family != _socket.AF_UNIX or type & ~(_socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC) != _socket.SOCK_STREAM:
            raise PermissionError("socketpair other than (AF_UNIX, SOCK_STREAM) is disabled in the hyflow sandbox")
        return stream_pair(family, type, proto)
    _socket.socketpair = socketpair
    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
                 "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                 "spawnvpe", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _blocked("starting processes"))
    _posixsubprocess.fork_exec = _blocked("starting processes")  # what subprocess.Popen uses

    def _quit(code=None):  # `exit()`/`quit()` normally come from the `site` module, skipped by -S
        raise SystemExit(code)
    builtins.exit = builtins.quit = _quit

    path = _C["solution"]
    sys.argv = [path]
    with open(path, encoding="utf-8") as file:
        source = file.read()
    main = types.ModuleType("__main__")  # a clean __main__ module for the solution, as `runpy` makes
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exit_:
        code = exit_.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _finish(code or 0)
    except BaseException as error:
        import traceback
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # hide the prelude frame
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(MEMORY_EXIT if isinstance(error, MemoryError) else 1)
    _finish(0)

def _finish(code):
    """Exit as the interpreter would (join non-daemon threads, atexit handlers, flush), minus its finalization:
    in a forked child that touches every object and copies every page (~6 ms a call)."""
    import atexit
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            code = 120  # what Python exits with when flushing stdout fails at shutdown
        except Exception:  # closed or replaced by the solution: Python ignores it too
            pass
    os._exit(code & 0xFF)

_supervise()
'''.replace("MEMORY_EXIT", str(MEMORY_ERROR_EXIT_CODE)).replace("DEADLINE_EXIT", str(DEADLINE_EXIT_CODE))


# Run inside the sandbox by `sandbox_guarantees`: tries what each guarantee forbids (or reads the kernel state
# that enforces it) and prints {guarantee: held} as a literal. _P is the parent's settings, a literal.
GUARANTEE_PROBE = r'''
import ctypes, hashlib, os, resource
_P = PROBE_SETTINGS

def _fails(action):
    try:
        action()
    except OSError:
        return True
    return False

def _read(path):
    with open(path, "rb") as file:
        return file.read()

def _fork_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    caps = [line for line in _read("/proc/self/status").splitlines() if line.startswith(b"CapEff:")]
    return soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and int(caps[0].split()[1], 16) == 0

def _outlives():  # a PID namespace whose init is the sandbox's own, or a uid of its own to kill
    try:
        init_is_ours = _P["prelude"].encode() in _read("/proc/1/cmdline")
    except OSError:
        init_is_ours = False
    return init_is_ours or os.getuid() not in (0, _P["uid"])

def _environ_unreadable():  # the same pid may exist in the sandbox's own /proc (e.g. a trainer that is pid 1)
    try:
        content = _read(_P["environ"])
    except OSError:
        return True
    return hashlib.sha256(content).hexdigest() != _P["environ_sha256"]

def _no_sockets():
    libc = ctypes.CDLL(None, use_errno=True)
    for family, kind in ((2, 1), (10, 2), (1, 1), (1, 2), (16, 3)):  # inet, inet6, unix stream/dgram, netlink
        fd = libc.socket(family, kind, 0)
        if fd >= 0:
            os.close(fd)
            return False
    return True

def _readonly():
    scratch = {"/tmp", "/dev/shm", os.getcwd()}
    for line in _read("/proc/self/mountinfo").decode("unicode_escape").splitlines():
        point = line.split()[4]
        try:  # the mount in view at that point (one covered by another is out of reach)
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:  # under a hidden directory
            continue
        # a mount below a scratch directory is scratch too (a checkout in a 0700 folder under /tmp: covered by the
        # sandbox's own /tmp, its point counted writable)
        if writable and not any(point == d or point.startswith(d.rstrip("/") + "/") for d in scratch):
            return False
    for directory in _P["import_paths"]:
        target = os.path.join(directory, "hyflow_guarantee_probe.pth")
        if not _fails(lambda: os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))):
            os.unlink(target)
            return False
    return True

def _scratch():
    if any(os.path.lexists(marker) for marker in _P["markers"]):
        return False
    for path in ("/tmp", "/dev/shm", os.getcwd()):
        if os.path.isdir(path):
            info = os.statvfs(path)
            if info.f_blocks * info.f_frsize > _P["scratch_bytes"]:
                return False
    return True

def _hidden():
    if any(os.path.lexists(entry) for entry in _P["home_entries"]):
        return False
    return all(_fails(lambda: _read(path)) or _read(path) == b"" for path in _P["hidden_files"])

def _importable():
    for path in _P["import_paths"]:
        if _fails(lambda: os.listdir(path)) or (_P["import_listings"][path] and not os.listdir(path)):
            return False
    return True

held = {}
for name, check in (("fork limit", _fork_limit), ("no process outlives the call", _outlives),
                    ("no sockets", _no_sockets),
                    ("trainer environment unreadable", _environ_unreadable),
                    ("read-only filesystem", _readonly),
                    ("private size-limited /tmp, /dev/shm and working directory", _scratch),
                    ("home directories and credentials hidden", _hidden),
                    ("the interpreter's standard library and site-packages importable", _importable)):
    try:
        held[name] = bool(check())
    except Exception as error:
        print(f"{name}: {type(error).__name__}: {error}", file=__import__("sys").stderr)
        held[name] = False
print(repr(held))
'''
