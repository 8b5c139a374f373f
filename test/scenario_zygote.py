"""The scenario zygote: one interpreter that imports upstream's launcher modules once, then forks one child per
scenario job (``suite_helpers.run_job``); the child becomes the interpreter that ``python -c CODE``, ``python
-m MODULE`` or a script of this venv would have started, and reports its exit status and output files as that
process would. test/README.md ("The scenario zygote") says why, what makes a child the fresh interpreter for
what the tests assert, and what was decided against. In short:

* Imported: ``PRELOAD`` (what ``python -m sglang.launch_server`` imports before it calls upstream's
  ``load_plugins()``) and a few standard-library modules of this file. Never ``sglang_cp``; ``load_plugins()``
  never ran; one thread; torch.distributed not initialised: checked before every fork (``_refusal``).
* The environment: a job forks only from a zygote whose imports read the same values (``mismatch``), and may
  not change one of those variables afterwards (``_guard_environment``) unless declared (``sets_env``).
* What the imports printed or set in the environment reaches every child; numpy's global generator is reseeded.

This file is both halves: the client (imported by ``suite_helpers``, standard library only) and the server,
which runs as ``python -c BOOT this_file dir`` so that ``__main__`` is a plain ``-c`` main module and nothing
of this file is in ``sys.modules`` under an importable name.
"""

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

# ---- what a zygote imports -----------------------------------------------------------------------------
# `python -m sglang.launch_server` imports these (its top-level imports) and then calls load_plugins(): a
# launcher or scheduler process of upstream's always has them, and more, imported when our plugin loads.
# test/unit/test_scenario_zygote.py keeps this list equal to launch_server's imports.
PRELOAD = ("sglang.srt.arg_groups.overrides", "sglang.srt.plugins", "sglang.srt.server_args", "sglang.srt.utils",
           "sglang.srt.utils.common")
OURS = "sglang_cp"
MAX_ZYGOTES = 3          # per pytest worker: one per distinct environment (as the preload reads it)
START_TIMEOUT_S = 300    # a zygote's start-up and imports, on a loaded 2-core machine
REPLY_TIMEOUT_S = 60     # the zygote's answer to a request (it answers between forks, never blocks)
JOB_TIMEOUT_S = 900      # a job given no timeout is still killed after this
KILL_GRACE_S = 30        # a killed child's exit status reaching us

# Names the C library reads itself (not through the getenv symbol getenv_trace.c replaces): compared always.
LIBC_NAMES = ("LANG", "LANGUAGE", "TZ", "TZDIR", "LOCPATH", "GCONV_PATH", "GLIBC_TUNABLES", "NLSPATH",
              "POSIXLY_CORRECT", "RES_OPTIONS", "LOCALDOMAIN", "HOSTALIASES", "TMPDIR")
LIBC_PREFIXES = ("LC_", "LD_", "MALLOC_")
# Code that iterates os.environ during the imports, and what it reads: the names with a prefix, taken from the
# reading frame. Known by (file, function, the source text that does the reading): changed code is an
# unknown reader again, and an unknown reader counts as reading every variable (then only a job with the
# zygote's whole environment forks from it).
ITERATIONS = (
    ("/tqdm/utils.py", "envwrap", "for k, v in os.environ.items() if k.startswith(prefix))",
     lambda frame: frame.f_locals["prefix"]),
    ("/sglang/srt/environ.py", "_handle_deprecated_envs", 'if key.startswith("SGL_") and key not in _DEPRECATED_ENVS:',
     lambda frame: "SGL_"),
)
_SAVED_PRELOAD = "SGLANG_CP_ZYGOTE_SAVED_LD_PRELOAD"  # the job's own LD_PRELOAD, while ours is first
# `python -S -c PROBE this_file`: what the interpreter's start-up reads in Python code (_probe_startup).
PROBE = "__import__('runpy').run_path(__import__('sys').argv[1], run_name='_scenario_zygote_probe')"
# `python -c BOOT this_file dir`: runs this file as the module `_scenario_zygote` (in no sys.modules), with what
# the interpreter had imported at start-up and the preload a test may ask for instead of PRELOAD.
BOOT = ("(lambda at_start: __import__('runpy').run_path(__import__('sys').argv[1], run_name='_scenario_zygote', "
        "init_globals={'MODULES_AT_START': at_start, 'PRELOAD_OVERRIDE': %r}))(set(__import__('sys').modules))")


def importing_env(env: dict, sets: dict | None) -> dict:
    """The environment a job's imports of upstream see: its own, plus what its program sets with
    os.environ.setdefault before importing upstream (as `sglang-cp check-args` sets HF_HUB_OFFLINE). The
    zygote is chosen by this; the child checks that the job did set them."""
    return {**(sets or {}), **env}


def mismatch(info: dict, env: dict) -> str | None:
    """Why a job with environment ``env`` must not fork from the zygote described by ``info`` (None: it may)."""
    zenv = info["env"]
    if info["all_read"]:
        keys = set(zenv) | set(env)
    else:
        prefixes = LIBC_PREFIXES + tuple(info["prefixes"])
        keys = set(info["read"]) | set(LIBC_NAMES) | {k for k in set(zenv) | set(env) if k.startswith(prefixes)}
    for k in sorted(keys):
        if zenv.get(k) != env.get(k):
            return f"{k} is {env.get(k)!r} for the job, {zenv.get(k)!r} when the zygote imported"
    return None


# ---- server (the zygote process) -----------------------------------------------------------------------

class _EnvironTrace:
    """While active: every name Python code reads from os.environ (and os.environb), and the prefixes read by
    the known iterations (``ITERATIONS``); other iterations are listed in ``unknown``."""

    def __init__(self):
        import inspect

        self.read, self.prefixes, self.unknown = set(), set(), []
        self.plain = type(os.environ)
        trace = self

        def caller():
            f = sys._getframe(2)
            while f is not None and f.f_code.co_filename in ("<frozen _collections_abc>", "<frozen os>"):
                f = f.f_back
            return f

        class Traced(self.plain):
            def __getitem__(self, key):
                f = sys._getframe(1)
                if not (f.f_code.co_name == "__iter__" and "_collections_abc" in f.f_code.co_filename):
                    trace.read.add(key if isinstance(key, str) else os.fsdecode(key))  # (items(): see __iter__)
                return super().__getitem__(key)

            def __iter__(self):
                f = caller()
                if f is not None and f.f_code.co_name == "<genexpr>":
                    f = f.f_back  # the function the generator expression is written in
                for suffix, function, line, prefix in ITERATIONS:
                    if f is not None and f.f_code.co_filename.endswith(suffix) and f.f_code.co_name == function \
                            and line in inspect.getsource(f.f_code):
                        trace.prefixes.add(prefix(f))
                        break
                else:
                    trace.unknown.append(f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
                                         if f is not None else "?")
                return super().__iter__()

        os.environ.__class__ = Traced
        os.environb.__class__ = Traced

    def stop(self) -> None:
        os.environ.__class__ = self.plain
        os.environb.__class__ = self.plain


def _probe_startup() -> None:
    """``python -S -c PROBE``: the names the interpreter's start-up reads in Python code (site: .pth files,
    sitecustomize, usercustomize), which runs before the zygote's own trace can start."""
    trace = _EnvironTrace()
    import site

    site.main()
    trace.stop()
    print("STARTUP " + json.dumps({"read": sorted(trace.read), "prefixes": sorted(trace.prefixes),
                                   "unknown": trace.unknown}))


def _serve(zdir: str, modules_at_start: set) -> None:
    import ctypes

    saved = os.environ.pop(_SAVED_PRELOAD)
    if saved == "":
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = saved[1:]  # "=" + the value: the job had its own
    start_env = dict(os.environ)
    path0 = os.path.join(zdir, "path0")  # an empty directory: nothing the imports find there
    sys.path[0] = path0
    # What start-up read in Python code, from an interpreter started as this one was (-S, then site by hand).
    probe = subprocess.run([sys.executable, "-S", "-c", PROBE, os.path.abspath(__file__)], capture_output=True,
                           text=True, env=start_env, cwd=path0, timeout=120)
    if "STARTUP " in probe.stdout:
        startup = json.loads(probe.stdout.split("STARTUP ", 1)[1])
    else:
        startup = {"read": [], "prefixes": [], "unknown": [f"the start-up probe failed: {probe.stderr[-2000:]}"]}

    argv_reads = []

    class TracedArgv(list):  # nothing should read sys.argv at import; the info says if something does
        def __getitem__(self, i):
            argv_reads.append(repr(i))
            return super().__getitem__(i)

        def __iter__(self):
            argv_reads.append("iter")
            return super().__iter__()

        def __len__(self):
            argv_reads.append("len")
            return super().__len__()

    trace = _EnvironTrace()
    sys.argv = TracedArgv(["-c"])
    t0 = time.monotonic()
    error = None
    try:
        for name in PRELOAD:
            __import__(name)
    except BaseException as e:  # reported to the client, which fails loudly
        import traceback

        error = "".join(traceback.format_exception(e))
    trace.stop()
    sys.argv = ["-c"]
    stop = ctypes.CDLL(None).zg_trace_stop
    stop.restype = ctypes.c_char_p
    names = stop()
    native = None if names is None else set(filter(None, names.decode(errors="replace").split("\n")))
    end_env = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(os.path.join(zdir, "pre.out"), "rb") as f:
        pre_out = f.read()
    with open(os.path.join(zdir, "pre.err"), "rb") as f:
        pre_err = f.read()
    log = os.open(os.path.join(zdir, "zygote.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import threading as _threading

    unknown = startup["unknown"] + trace.unknown
    info = {
        "pid": os.getpid(), "env": start_env,
        "read": sorted(trace.read | set(startup["read"]) | (native or set())),
        "prefixes": sorted(trace.prefixes | set(startup["prefixes"])),
        "all_read": bool(unknown) or native is None, "unknown_readers": unknown, "argv_reads": argv_reads,
        "native_trace": native is not None, "set": {k: v for k, v in end_env.items() if start_env.get(k) != v},
        "unset": sorted(set(start_env) - set(end_env)), "threads": _threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")), "modules": len(sys.modules),
        "preload_s": round(time.monotonic() - t0, 1), "error": error, "refusal": _refusal(),
    }
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(zdir, "sock"))
    listener.listen(64)
    with open(os.path.join(zdir, "info.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(zdir, "info.tmp"), os.path.join(zdir, "info.json"))
    state = {"info": info, "pre_out": pre_out, "pre_err": pre_err, "path0": path0, "listener": listener,
             "tops": {m.split(".")[0] for m in set(sys.modules) - modules_at_start}}
    _loop(state)


def _refusal() -> str | None:
    """Why this process must not fork a job now (None: it may). Checked before every fork."""
    import threading as _threading

    ours = sorted(m for m in sys.modules if m == OURS or m.startswith(OURS + "."))
    if ours:
        return f"{OURS} is imported in the zygote ({', '.join(ours[:5])}): the job would not load the plugin fresh"
    plugins = sys.modules.get("sglang.srt.plugins")
    if plugins is not None and getattr(plugins, "_plugins_loaded", False):
        return "upstream's load_plugins() has run in the zygote"
    registry = sys.modules.get("sglang.srt.plugins.hook_registry")
    hooks = getattr(registry, "HookRegistry", None)
    if hooks is not None and (any(hooks._hooks.values()) or hooks._patched):
        return "upstream's HookRegistry holds hooks in the zygote"
    if _threading.active_count() != 1:
        return f"the zygote runs {_threading.active_count()} Python threads: a fork would copy their locks"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "torch.distributed is initialised in the zygote: a job's process group must be its own"
    return None


def _shadowed(state: dict, first: str) -> str | None:
    """A module the zygote imported that the job's sys.path[0] would have found first (another file)."""
    try:
        entries = os.listdir(first or ".")
    except OSError:
        return None
    for entry in entries:
        name, path = entry.split(".", 1)[0], os.path.join(first or ".", entry)
        if name not in state["tops"]:
            continue
        init = os.path.join(path, "__init__.py")
        found = init if os.path.isfile(init) else path if entry.endswith((".py", ".pyc", ".so")) else None
        mine = getattr(sys.modules.get(name), "__file__", None)  # a directory without __init__ shadows nothing
        if found and not (mine and os.path.realpath(mine) == os.path.realpath(found)):
            return f"{found!r} in the job's sys.path[0] ({first or os.getcwd()!r}) would shadow the preloaded {name!r}"
    return None


def _loop(state: dict) -> None:
    import signal

    listener = state["listener"]
    conns = {}     # socket -> bytes received so far
    children = {}  # pid -> socket
    by_conn = {}   # socket -> pid

    def send(conn, obj):
        try:
            conn.sendall((json.dumps(obj) + "\n").encode())
        except OSError:
            pass

    def drop(conn):
        conns.pop(conn, None)
        pid = by_conn.pop(conn, None)
        if pid is not None and pid in children:
            os.kill(pid, signal.SIGKILL)  # its client is gone: nobody will read its output
        conn.close()

    while True:
        ready, _, _ = select.select([listener, 0, *conns], [], [], 0.1)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                send(conn, {"status": status})
                by_conn.pop(conn, None)
        if 0 in ready and os.read(0, 4096) == b"":  # the client closed our stdin: it is gone, or done
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)
        if listener in ready:
            conn, _ = listener.accept()
            conns[conn] = b""
        for conn in [c for c in ready if c in conns]:
            data = conn.recv(1 << 20)
            if not data:
                drop(conn)
                continue
            conns[conn] += data
            while b"\n" in conns.get(conn, b""):
                line, conns[conn] = conns[conn].split(b"\n", 1)
                req = json.loads(line)
                if "kill" in req:
                    pid = by_conn.get(conn)
                    if pid is not None and pid in children:
                        os.kill(pid, signal.SIGKILL)
                    continue
                reply = _check(state, req)
                if reply is not None:
                    send(conn, reply)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in conns:
                        c.close()
                    _become(state, req)  # never returns
                children[pid] = conn
                by_conn[conn] = pid
                send(conn, {"pid": pid})


def _check(state: dict, req: dict) -> dict | None:
    """The reply that refuses ``req`` (run it as a new interpreter, or fail), or None to fork it."""
    refusal = _refusal()
    if refusal:
        return {"error": refusal}
    reason = mismatch(state["info"], req["zenv"])
    if reason:
        return {"fresh": reason}
    if state["path0"] not in sys.path:
        return {"fresh": "the preload removed the zygote's sys.path[0]"}
    with _cwd(req["cwd"]):
        reason = _shadowed(state, req["first"])
    return {"fresh": reason} if reason else None


class _cwd:
    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.old = os.getcwd()
        os.chdir(self.path)

    def __exit__(self, *exc):
        os.chdir(self.old)


def _become(state: dict, req: dict) -> None:
    """In the forked child: become the interpreter the job's command line starts, run it, exit with its status."""
    try:
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.write(1, state["pre_out"])  # what the imports printed, as the job's own imports would have
        os.write(2, state["pre_err"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(state["info"]["set"])  # what the imports set (from what they read: the job's values)
        for k in state["info"]["unset"]:
            os.environ.pop(k, None)
        os.chdir(req["cwd"])
        sys.path[sys.path.index(state["path0"])] = req["first"]
        sys.argv = list(req["argv"])
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            np_random.seed()  # numpy seeds its global generator from the OS at import: draw again
        _guard_environment(state["info"], req["out"] + ".envguard")
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    code = _run(req["kind"], req["target"])
    unset = {k: v for k, v in req["sets"].items() if k not in req["env"] and os.environ.get(k) != v}
    if unset:  # the zygote imported under values the job said it sets, and it did not: not a fresh run
        msg = (f"scenario zygote: the job was declared to set {unset} before importing upstream (sets_env), "
               "and did not: its zygote imported upstream under those values.\n")
        with open(req["out"] + ".envguard", "w") as f:
            f.write(msg)
        os.write(2, msg.encode())
        os._exit(125)
    os._exit(code & 0xFF)


def _guard_environment(info: dict, marker: str) -> None:
    """In the child: a job that changes a variable the zygote's imports read (as a program that sets
    HF_HUB_OFFLINE before importing huggingface_hub does) would have imported upstream under another value;
    it stops at that write, and its client fails naming the variable (the job runs with the value in its
    environment, declares it with ``sets_env``, or runs as a new interpreter: ``fresh_interpreter=True``)."""
    zenv, names = info["env"], set(info["read"]) | set(LIBC_NAMES)
    prefixes = LIBC_PREFIXES + tuple(info["prefixes"])

    def check(key, value):
        key = key if isinstance(key, str) else os.fsdecode(key)
        value = value if value is None or isinstance(value, str) else os.fsdecode(value)
        if (info["all_read"] or key in names or key.startswith(prefixes)) and value != zenv.get(key) \
                and value != os.environ.get(key):  # (setting the value it has changes nothing)
            msg = (f"scenario zygote: the job sets {key}={value!r}, which upstream's modules read when they were "
                   f"imported ({zenv.get(key)!r} then): in a new interpreter they would see its value. Put it in "
                   "the job's environment, or declare it (run_job(..., sets_env={...}) if the program sets it "
                   "before importing upstream), or run_job(..., fresh_interpreter=True).\n")
            with open(marker, "w") as f:
                f.write(msg)
            os.write(2, msg.encode())
            os._exit(125)

    class Guarded(type(os.environ)):
        def __setitem__(self, key, value):
            check(key, value)
            super().__setitem__(key, value)

        def __delitem__(self, key):
            check(key, None)
            super().__delitem__(key)

    os.environ.__class__ = Guarded
    os.environb.__class__ = Guarded


def _run(kind: str, target: str) -> int:
    """Run the job's code as the interpreter runs its main module; its exit status, after finalization."""
    import atexit
    import runpy
    import threading as _threading
    import traceback
    import types

    code = 0
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            main = types.ModuleType("__main__")
            main.__dict__.update(__builtins__=sys.modules["builtins"], __loader__=sys.modules["__main__"].__loader__,
                                 __annotations__={})
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:  # as the interpreter: None -> 0, an int -> itself, anything else printed -> 1
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the interpreter's report of an uncaught exception (a hook may own it)
        code = 1
    try:  # as the interpreter's finalization: wait for non-daemon threads, then run atexit handlers
        _threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


# ---- client (in the pytest worker) ---------------------------------------------------------------------

class ZygoteError(RuntimeError):
    """The zygote refused a job for a reason no new interpreter would fix, or died."""


def _shim() -> str | None:
    """getenv_trace.c built once per source version (None: no C compiler here)."""
    import hashlib
    import shutil
    import stat

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "getenv_trace.c")
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    # LD_PRELOADed into every zygote: kept in a directory only this user can write (never a name another user
    # could plant in the shared temp directory), checked without following a link.
    home = os.path.join(tempfile.gettempdir(), f"sglang-cp-test-{os.getuid()}")
    try:
        os.mkdir(home, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(home)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ZygoteError(f"{home}: not a private directory of this user (mode 0700, owned by uid {os.getuid()}); "
                          "remove it")
    out = os.path.join(home, f"getenv-trace-{digest}.so")
    if os.path.exists(out):
        return out
    cc = shutil.which(os.environ.get("CC", "cc").split()[0]) or shutil.which("gcc")
    if cc is None:
        return None
    tmp = f"{out}.{os.getpid()}.{threading.get_ident()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, src], check=True, capture_output=True, timeout=120)
    os.replace(tmp, out)
    return out


class Zygote:
    """One zygote process, started with ``env`` and importing ``preload`` (``PRELOAD`` unless a test asks)."""

    def __init__(self, env: dict, preload: tuple | None = None, shim: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="sglang-cp-zygote-")
        os.mkdir(os.path.join(self.dir, "path0"))
        shim = shim or _shim()
        if shim is None:
            raise ZygoteError("no C compiler (cc) to build test/getenv_trace.c")
        penv = dict(env)
        penv[_SAVED_PRELOAD] = "" if "LD_PRELOAD" not in env else "=" + env["LD_PRELOAD"]
        penv["LD_PRELOAD"] = shim + (" " + env["LD_PRELOAD"] if "LD_PRELOAD" in env else "")
        self.preload = tuple(PRELOAD if preload is None else preload)
        boot = BOOT % (None if preload is None else self.preload,)
        with open(os.path.join(self.dir, "pre.out"), "wb") as out, open(os.path.join(self.dir, "pre.err"), "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", boot, os.path.abspath(__file__), self.dir],
                                         stdin=subprocess.PIPE, stdout=out, stderr=err, env=penv,
                                         cwd=os.path.join(self.dir, "path0"))
        self.info = self._wait_ready()
        self.busy = 0

    def _wait_ready(self) -> dict:
        path = os.path.join(self.dir, "info.json")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise ZygoteError(f"the zygote did not start (exit {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.05)
        with open(path) as f:
            info = json.load(f)
        if info["error"]:
            self.close()
            raise ZygoteError(f"the zygote's imports failed:\n{info['error']}")
        return info

    def log(self) -> str:
        text = []
        for name in ("pre.err", "zygote.log"):
            try:
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text.append(f.read()[-4000:])
            except OSError:
                pass
        return "\n".join(text)

    def run(self, kind: str, target: str, argv: list, env: dict, cwd: str, timeout: float | None,
            sets: dict | None = None):
        """The job's (returncode, stdout bytes, stderr bytes), or ("fresh", reason) when it must run as a new
        interpreter. Raises subprocess.TimeoutExpired after killing a job past ``timeout``. ``sets``: what the
        job's program sets with os.environ.setdefault before it imports upstream (see ``importing_env``)."""
        first = {"code": "", "module": os.path.abspath(cwd), "path": os.path.dirname(os.path.abspath(target))}[kind]
        with tempfile.TemporaryDirectory(prefix="sglang-cp-job-") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            req = {"kind": kind, "target": target, "argv": argv, "env": env, "zenv": importing_env(env, sets),
                   "sets": sets or {}, "cwd": os.path.abspath(cwd), "first": first, "out": out, "err": err}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(REPLY_TIMEOUT_S)
                s.connect(os.path.join(self.dir, "sock"))
                s.sendall((json.dumps(req) + "\n").encode())
                buf = bytearray()
                reply = self._reply(s, buf, REPLY_TIMEOUT_S)
                if "fresh" in reply:
                    return "fresh", reply["fresh"]
                if "error" in reply:
                    raise ZygoteError(reply["error"])
                timeout = JOB_TIMEOUT_S if timeout is None else timeout
                try:
                    status = self._reply(s, buf, timeout)["status"]
                except TimeoutError:
                    s.sendall(b'{"kill": 1}\n')
                    self._reply(s, buf, KILL_GRACE_S)
                    raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err)) from None
            guard = _read(out + ".envguard")
            if guard:
                raise ZygoteError(guard.decode())
            return os.waitstatus_to_exitcode(status), _read(out), _read(err)

    def _reply(self, s, buf: bytearray, timeout: float | None) -> dict:
        """The zygote's next line on ``s`` (TimeoutError past ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in buf:
            s.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
            try:
                data = s.recv(65536)
            except socket.timeout:
                raise TimeoutError from None
            if not data:
                raise ZygoteError(f"the zygote closed the connection (exit {self.proc.poll()}):\n{self.log()}")
            buf += data
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        return json.loads(line)

    def close(self) -> None:
        import shutil

        try:
            self.proc.stdin.close()  # the zygote kills its children and exits
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


_zygotes: list = []
_lock = threading.Lock()
_closing = False


def zygote_for(env: dict) -> tuple:
    """(the zygote a job with ``env`` may fork from, None) or (None, why it runs as a new interpreter). Mark
    the zygote busy; ``release`` it after the job. Past MAX_ZYGOTES, the least recently used idle zygote
    makes room (memory: each holds ~0.8 GB of imports)."""
    global _closing
    with _lock:
        for z in _zygotes:
            if mismatch(z.info, env) is None:
                _zygotes.remove(z)
                _zygotes.append(z)  # most recently used last
                z.busy += 1
                return z, None
        if len(_zygotes) >= MAX_ZYGOTES:
            idle = [z for z in _zygotes if z.busy == 0]
            if not idle:
                return None, f"{MAX_ZYGOTES} zygotes are busy; " + mismatch(_zygotes[-1].info, env)
            _zygotes.remove(idle[0])
            idle[0].close()
        if not _closing:
            import atexit

            atexit.register(close_all)
            _closing = True
        why = "first" if not _zygotes else mismatch(_zygotes[-1].info, env)
        z = Zygote(env)
        _log_start(z, why)
        _zygotes.append(z)
        z.busy += 1
        return z, None


def _log_start(z: "Zygote", why: str) -> None:
    """With SGLANG_CP_TEST_JOB_LOG=<file> (suite_helpers): a line per zygote started, and why another."""
    path = os.environ.get("SGLANG_CP_TEST_JOB_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "how": "zygote started",
                                "why": why, "preload_s": z.info["preload_s"]}) + "\n")


def release(z: "Zygote") -> None:
    with _lock:
        z.busy -= 1


def close_all() -> None:
    with _lock:
        while _zygotes:
            _zygotes.pop().close()


if __name__ == "_scenario_zygote_probe":  # python -S -c PROBE this_file
    _probe_startup()
if __name__ == "_scenario_zygote":  # the server: python -c BOOT this_file dir
    if PRELOAD_OVERRIDE is not None:  # noqa: F821 (BOOT's init_globals)
        PRELOAD = PRELOAD_OVERRIDE  # noqa: F821
    _serve(sys.argv[2], MODULES_AT_START)  # noqa: F821
