"""Faults: processes that die with the one that started them, and a watchdog that ends a job whose rank stalls.

`die_with_parent()` asks Linux to signal this process when its parent exits (prctl PR_SET_PDEATHSIG): a worker
of `fivefold train --nproc N`, `bench`, `calibrate` or a run of `fivefold sweep` calls it first thing, so a
`kill -9` of the launcher leaves no worker behind. (`preexec_die_with_parent` does the same for a child started
with `subprocess.Popen`.)

`Watchdog` runs a thread in every rank of a multi-process job. Each rank records what it is doing (`note`:
step, micro-batch, schedule action) and publishes a heartbeat into the launcher's key-value store every few
seconds, and reads the heartbeat of one rank only: the next one round the ring that has not finished, so that every
rank is watched by one neighbour and the store serves three requests per rank per interval (not one per pair of
ranks). A rank whose heartbeat stops (stopped with SIGSTOP, killed, or hung holding the interpreter) or that
makes no progress for `train.collective_timeout_s` ends the job: its watcher (or the rank itself, for no progress)
prints which rank stalled and what it was doing, kills that rank when it runs on the same host, and exits with status
`WATCHDOG_EXIT`; the launcher then stops the remaining ranks. The process group's own timeout (the same
`train.collective_timeout_s`, given to `init_process_group`) is the backstop.

`RunLock` makes one process the owner of a run directory (an exclusive `flock` on `RUN_DIR/run.lock`, released by
the kernel however its holder dies); `SaveAbandoned` is what a second stop signal raises while a run stops;
`StopSignal` is what SIGTERM or SIGHUP raise outside the training loop (`stop_signals_interrupt`), and
`stop_signals_deferred` holds those signals and SIGINT back while a removal that must not stop half done runs.
`wait_for_ranks` meets every rank in the launcher's store before the process group forms, within the same timeout:
a rank that never arrives (stalled or dead during start-up) is named. `record_failure` leaves a rank's one-line
error where its launcher reads it (`first_failure`), so the launcher's summary names the rank that failed first
and its line, not a peer's report of losing it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from fivefold.config import missing_dirs
from fivefold.errors import CliError, EnvironmentFailure

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
WATCHDOG_EXIT = 4  # exit status of the rank that reports a stalled job
OTHERS_SHOWN = 15  # ranks whose activity a stall report lists besides the stalled one and the reporter
FAILURES_DIR_ENV = "FIVEFOLD_FAILURES_DIR"  # set by the launcher for its workers: where each leaves its error line
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux; a no-op elsewhere). Returns
    whether the request took. When the parent is already gone (adopted by init), sends `sig` now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the request: nobody will signal us
        os.kill(os.getpid(), sig)
    return True


def preexec_die_with_parent() -> None:
    """`subprocess.Popen(preexec_fn=...)`: the child gets SIGTERM when the process that started it exits (its
    own launcher then stops its workers, which die with it in any case)."""
    die_with_parent(signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere). The launcher starts its workers in sessions
    of their own, so signalling its process group would miss them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class SaveAbandoned(BaseException):
    """A second stop signal (SIGINT, SIGTERM, SIGHUP) while a run stops on the first one: the checkpoint it was
    writing is abandoned (a `.tmp` directory without COMPLETE, which no reader trusts). A BaseException, as
    KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the training loop, while `stop_signals_interrupt` is active: raised in the main
    thread like Ctrl-C's KeyboardInterrupt (a subclass of it), so that the same clean-up runs (a staging directory
    removed, the run lock released), and the command line says `stopped by NAME ...` and exits with 128 + its
    number. `after`: what the line adds (what was, or was not, left)."""

    def __init__(self, signum: int, after: str = "") -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.after = after


@contextlib.contextmanager
def stop_signals_interrupt(after: str = ""):
    """While active (in the main thread; elsewhere it does nothing), SIGTERM and SIGHUP raise `StopSignal` (SIGINT
    raises KeyboardInterrupt already); the handlers before are restored on exit. After SIGHUP output to a closed
    terminal goes to /dev/null."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            quiet_hung_up_terminal()
        raise StopSignal(signum, after)

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_deferred():
    """While active (in the main thread, where Python runs every signal handler; elsewhere it does nothing), SIGINT,
    SIGTERM and SIGHUP are noted instead of handled, so that the work inside (removing a staging directory) runs to
    its end rather than stopping half done; on exit the handlers before are restored and the first signal noted is
    handled as they would have handled it (`StopSignal` or KeyboardInterrupt raised, or the default action). The
    handlers, not the signal mask: a process-directed signal that the main thread blocks is delivered to another
    thread (the tokenizer's), whose interrupt Python runs in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note_signal(signum: int, frame: object) -> None:
        noted.append(signum)

    previous = {signum: signal.signal(signum, note_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if noted:
            handler = previous[noted[0]]
            if callable(handler):
                handler(noted[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), noted[0])


def quiet_hung_up_terminal() -> None:
    """After SIGHUP (a closed terminal, a dropped SSH session) writes to the terminal fail: point this process's
    stdout and stderr at /dev/null where they were a terminal, so that the run can still save and exit."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(null, fd)
    os.close(null)


class Watchdog:
    """One rank's heartbeat thread; see the module's docstring. `store` is a torch.distributed Store shared by
    the ranks (`connect_store()` opens the launcher's)."""

    def __init__(self, rank: int, world: int, timeout_s: float, store, interval_s: float | None = None,
                 on_stall=None) -> None:
        self.rank, self.world, self.timeout_s, self.store = rank, world, timeout_s, store
        self.on_stall = on_stall or _end_job  # (message, the stalled rank's heartbeat or None, this host)
        self.interval_s = interval_s or min(5.0, timeout_s / 20)
        # a silent rank is named after 0.8 x the timeout (found by 0.9 x), before the process group's own timeout
        # raises in a collective and before a rank waiting on it counts as making no progress itself (1 x)
        self.stall_s = 0.8 * timeout_s
        self.progress_s = timeout_s
        self.fields: dict[str, object] = {}
        self.changed = time.monotonic()
        self.beats = 0
        self.host = socket.gethostname()
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat count, our clock when it changed)
        self.watching = (rank + 1) % world  # the rank whose heartbeat this one reads (`_watched`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop watching and tell the other ranks this one has finished (not stalled)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"hb/{self.rank}", json.dumps({"done": True}))

    def note(self, **fields: object) -> None:
        """Record what this rank is doing now (e.g. step=3, micro_batch=1, action="F1 stage 0")."""
        self.fields.update(fields)
        self.changed = time.monotonic()

    def describe(self, fields: dict | None = None) -> str:
        f = self.fields if fields is None else fields
        return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in f.items() if v is not None) or "start-up"

    def _publish(self) -> None:
        self.beats += 1
        self.store.set(f"hb/{self.rank}", json.dumps({
            "beat": self.beats, "pid": os.getpid(), "host": self.host, "doing": self.describe(),
            "idle_s": time.monotonic() - self.changed}))

    def _read(self, rank: int) -> dict | None:
        key = f"hb/{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _watched(self) -> tuple[int, dict | None] | None:
        """(the rank this one watches, its heartbeat): the next one round the ring that has not finished (None when
        every other rank has). Each rank is thus watched by its nearest unfinished predecessor, and reads one
        heartbeat per interval."""
        r = self.watching
        while r != self.rank:
            hb = self._read(r)
            if hb is None or not hb.get("done"):
                return r, hb
            r = (r + 1) % self.world  # finished: watch the next one (each rank is passed over once, for good)
            self.watching = r
        return None

    def tick(self, start: float) -> bool:
        """One interval: publish this rank's heartbeat, read the watched rank's, and report a stall (the watched rank
        silent for 0.8 x the timeout, or this rank without progress for the timeout). True once it reported. Store
        requests per interval: one write and two reads (`check`, `get`), whatever the world's size."""
        self._publish()
        now = time.monotonic()
        watched = self._watched()
        stalled = None
        if watched is not None:
            r, hb = watched
            count = hb["beat"] if hb else 0
            last = self.seen.get(r)
            if last is None or last[0] != count:
                self.seen[r] = (count, now if last is not None or hb is not None else start)
            elif now - last[1] > self.stall_s:
                stalled = (r, hb, f"sent no heartbeat for {now - last[1]:.0f} s (stopped, killed or hung)")
        if stalled is None and "step" in self.fields and now - self.changed > self.progress_s:
            stalled = (self.rank, None, f"made no progress for {now - self.changed:.0f} s")
        if stalled is None:
            return False
        r, hb, why = stalled
        doing = hb["doing"] if hb else "start-up (no heartbeat yet)"
        others = [f"rank {self.rank}: {self.describe()}"] if r != self.rank else []
        shown_ranks = [q for q in range(self.world) if q not in (r, self.rank)]
        for q in shown_ranks[:OTHERS_SHOWN]:  # read once, when reporting
            b = self._read(q)
            others.append(f"rank {q}: {b['doing'] if b and 'doing' in b else ('done' if b else 'unknown')}")
        if len(shown_ranks) > OTHERS_SHOWN:
            others.append(f"{len(shown_ranks) - OTHERS_SHOWN} more ranks not listed")
        message = (f"rank {r} {why}, while at {doing if r != self.rank else self.describe()} "
                   f"(train.collective_timeout_s = {self.timeout_s:g}); ending the job. Other ranks: "
                   f"{'; '.join(others) or 'none'}")
        self.on_stall(message, hb if r != self.rank else None, self.host)
        return True

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                if self.tick(start):
                    return
            except Exception:  # the store went away: the launcher is ending the job
                return


def _end_job(message: str, stalled: dict | None, host: str) -> None:
    """Print the message, kill the stalled rank when it runs on this host (SIGKILL works on a stopped one), and
    exit at once with `WATCHDOG_EXIT`: the launcher then stops every other rank."""
    print(f"fivefold: error: {message}", file=sys.stderr, flush=True)
    record_failure(message, peer=False)
    if stalled and stalled.get("host") == host:
        with contextlib.suppress(OSError, ValueError, KeyError):
            os.kill(int(stalled["pid"]), signal.SIGKILL)
    os._exit(WATCHDOG_EXIT)


def connect_store(timeout_s: float, prefix: str = "fivefold-watchdog/"):
    """A client of the key-value store the launcher set up (MASTER_ADDR, MASTER_PORT), keys under a prefix of
    our own."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=max(timeout_s, 30.0)))
    return dist.PrefixStore(prefix, store)


class _Current:
    """The watchdog of this process, if one runs (at most one per process; `note` is a no-op otherwise)."""

    watchdog: Watchdog | None = None


def start_watchdog(rank: int, world: int, timeout_s: float) -> Watchdog | None:
    """Start this rank's watchdog (multi-process jobs only); later `note(...)` calls feed it."""
    if world <= 1 or _Current.watchdog is not None:
        return _Current.watchdog
    try:
        store = connect_store(timeout_s)
    except (KeyError, ValueError, RuntimeError) as e:  # no launcher's store to meet in: the group's timeout only
        print(f"fivefold: warning: rank {rank}: no watchdog ({e}); a stalled rank ends the job through the process "
              f"group's timeout (train.collective_timeout_s = {timeout_s:g})", file=sys.stderr)
        return None
    _Current.watchdog = Watchdog(rank, world, timeout_s, store).start()
    return _Current.watchdog


def note(**fields: object) -> None:
    """Record what this rank is doing for the watchdog (cheap; nothing happens without one)."""
    if _Current.watchdog is not None:
        _Current.watchdog.note(**fields)


# ---------------------------------------------------------------------------------------------------------------
# One owner per run directory

RUN_LOCK = "run.lock"  # RUN_DIR/run.lock: flock-ed by the run's owner, who writes its host, pid and start time


class RunDirBusy(CliError):
    """The run directory belongs to a run in progress (its lock is held)."""


def try_flock(path: Path) -> int | None:
    """An exclusive `flock` on `path` (created if missing): its descriptor, or None while another open file holds
    it. The kernel releases it when the holder closes it or dies, however it dies, so a stale lock file is free."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            return None
        raise
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunLock:
    """The exclusive lock of a run directory (`RUN_DIR/run.lock`), held by the process that owns the run for its
    whole life: a one-process run, the launcher of `--nproc N`, or rank 0 of a job started by torchrun. Taken before
    anything is written into the directory (it creates a missing one); released, the lock file removed, when the
    run ends, and by the kernel when its holder dies. A second run of the directory is refused (`RunDirBusy`)
    naming the holder's host, pid and start time."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_LOCK
        self.fd: int | None = None
        self.created: list[Path] = []  # the directories that `acquire` created, parents first

    def acquire(self) -> RunLock:
        try:
            while True:
                self.make_run_dir()
                try:
                    fd = try_flock(self.path)
                except FileNotFoundError:  # another start's write test removed the directory it had created
                    continue
                if fd is None:
                    raise RunDirBusy(f"run directory {self.run_dir} is in use by {describe_holder(self.path)} (it "
                                     f"holds {self.path}); wait for that run to end or stop it, or choose another "
                                     "--run-dir")
                if _same_file(fd, self.path):  # not a file that its last holder removed meanwhile
                    break
                os.close(fd)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a file system without locks
                print(f"fivefold: warning: {self.path} cannot be locked ({e.strerror}); nothing stops a second run "
                      "from using this run directory at the same time", file=sys.stderr)
                return self
            raise CliError(f"run directory {self.run_dir} cannot be used: {self.path}: {e.strerror or e}; choose "
                           "a run directory under a writable directory") from None
        os.ftruncate(fd, 0)
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(sys.orig_argv)}
        os.write(fd, (json.dumps(holder) + "\n").encode())
        self.fd = fd
        return self

    def make_run_dir(self) -> None:
        """Create the run directory and its missing parents, remembering which, to remove them if the run writes
        nothing (a refused start leaves the file system as it found it)."""
        for p in reversed(missing_dirs(self.run_dir)[0]):
            with contextlib.suppress(FileExistsError):
                p.mkdir()
                self.created.append(p)

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no waiter holds a removed file) and let go; remove the
        run directory too if this lock created it and nothing else was written."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None
        for p in reversed(self.created):
            try:
                p.rmdir()
            except OSError:
                break

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_holder(path: Path) -> dict | None:
    """What the holder of a run lock wrote (None until it wrote it)."""
    for _ in range(20):  # the holder writes right after it takes the lock
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
        time.sleep(0.05)
    return None


def describe_holder(path: Path) -> str:
    h = read_holder(path)
    if h is None:
        return "another process (it has not written its host and pid yet)"
    return f"pid {h.get('pid')} on host {h.get('host')}, started {h.get('started')}"


def held_by_parent(run_dir: str | Path) -> bool:
    """Whether this process's parent, on this host, holds the run directory's lock: a worker that the launcher of
    `--nproc N` started, which owns the run for it."""
    path = Path(run_dir) / RUN_LOCK
    h = read_holder(path) if path.is_file() else None
    return bool(h) and h.get("pid") == os.getppid() and h.get("host") == socket.gethostname()


def record_failure(line: str, peer: bool) -> None:
    """Leave this rank's error line for its launcher (in a worker of `launch` only): `peer` when it reports losing
    another rank rather than a failure of its own."""
    folder = os.environ.get(FAILURES_DIR_ENV)
    rank = os.environ.get("RANK")
    if not folder or rank is None:
        return
    with contextlib.suppress(OSError):
        with open(os.path.join(folder, f"rank{int(rank)}.json"), "w") as f:
            json.dump({"rank": int(rank), "time": time.time(), "line": line, "peer": peer}, f)


def first_failure(folder: str, exit_codes: dict[int, int]) -> tuple[int, str] | None:
    """(rank, what happened to it) of the rank that failed first: the earliest line of a rank's own failure, else a
    rank killed by a signal (its peers' lines report losing it), else the earliest line; None without either."""
    lines = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(os.path.join(folder, name)) as f:
                r = json.load(f)
            lines.append((bool(r["peer"]) or not r["line"], float(r["time"]), int(r["rank"]), str(r["line"])))
    own = sorted(x for x in lines if not x[0])
    if own:
        return own[0][2], own[0][3]
    # a rank killed by a signal, other than the SIGTERM with which the launcher stops the rest of a failed job; a
    # rank whose runtime aborted (SIGABRT: gloo's threads can abort a rank whose peer died mid-collective) after one
    # killed from outside (SIGKILL: the OOM killer, a user)
    # then a rank that exited with an error of its own (an exception the record did not catch): the SIGABRT of a peer
    # that lost it and the SIGTERM with which the launcher stopped the rest came after it
    order = sorted((0 if code < 0 and code not in (-signal.SIGTERM, -signal.SIGABRT) else 1 if code > 0
                    else 2 if code == -signal.SIGABRT else 3, r) for r, code in exit_codes.items() if code)
    if order:
        rank = order[0][1]
        code = exit_codes[rank]
        if code > 0:
            return rank, f"exited with code {code} (its traceback is above)"
        with contextlib.suppress(ValueError):
            return rank, f"killed by {signal.Signals(-code).name}"
    lines.sort()
    return (lines[0][2], lines[0][3] or "lost another rank") if lines else None


def wait_for_ranks(rank: int, world: int, timeout_s: float) -> None:
    """Meet every rank of the job in the launcher's store before the process group forms; a rank missing after
    `timeout_s` (stalled or dead during start-up) is named in an EnvironmentFailure. Without the launcher's store
    (MASTER_ADDR unset), returns: the process group's own rendezvous then waits."""
    if world <= 1:
        return
    try:
        store = connect_store(timeout_s, prefix="fivefold-join/")
    except (KeyError, ValueError, RuntimeError):
        return
    store.set(f"rank{rank}", socket.gethostname())
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if not store.check([f"rank{r}"])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(min(0.1, timeout_s / 50))
    if missing:
        names = ", ".join(map(str, missing))
        raise EnvironmentFailure(
            f"rank{'s' if len(missing) > 1 else ''} {names} of {world} did not join the job within "
            f"train.collective_timeout_s = {timeout_s:g} s (stalled or dead during start-up); nothing was trained or "
            "written by this start; start the job again (a --resume continues from the newest checkpoint)")
