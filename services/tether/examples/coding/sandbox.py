"""The coding agent's sandbox: one bash command at a time in a working copy that holds only source files.

Every command runs in fresh Linux namespaces (`unshare`): a user namespace (no privilege on the host),
its own network namespace (only a loopback that is down: no network at all), its own PID namespace
(killing its first process kills everything the command left behind) and its own mount namespace,
in which:

- the root is a new one, allow-listed: the system's own trees (``/usr``, ``/etc`` and the links into
  ``/usr``) read-only, ``/dev/null``, ``zero``, ``random`` and ``urandom``, a private ``/proc`` and a
  small private ``/tmp``; the working copy is bind-mounted at ``/tmp/work`` (the command's directory)
  and is the only thing writable. The host's root is pivoted away and detached, so no path reaches
  anything else on the host (the temporary directory with other rollouts' copies and the hidden tests,
  home directories, another checkout of this repository and its ``.git``, the run's tasks);
- inside those trees, the directories that may hold the task generator (the Tether package, its
  virtualenv, an install under ``/usr/local``) are covered by empty tmpfs mounts;
- the command runs in a second, nested user and mount namespace, so the mounts above are locked
  (``umount /tmp`` fails) and cannot be peeled off.

The environment is scrubbed (a fixed PATH, no proxies, ``PIP_NO_INDEX=1``, no HOME), files are capped
at 1 MiB (``ulimit -f``), each command has a wall-clock timeout and its output is cut at a budget.
When the kernel refuses unprivileged namespaces the sandbox refuses to run (`SandboxUnavailable`):
there is no weaker fallback.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The command's view of its working copy.
WORKDIR = "/tmp/work"
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PIP_NO_INDEX": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PAGER": "cat",
}
FILE_SIZE_LIMIT_KB = 1024

# Runs as the sandbox's first process (PID 1 of its PID namespace) with the working copy and the
# directories to hide as arguments. It builds a new root that holds only the system's own trees (read-only),
# a few device nodes, a private /proc and /tmp, and the working copy; pivots into it and detaches the
# host's root, so nothing else of the host (another checkout, its .git, the tests) is reachable by any
# path; then runs the command in a nested namespace that locks these mounts.
_PROLOGUE = r"""
set -e
PATH=/usr/sbin:/sbin:$PATH  # pivot_root
work="$1"; shift
new=/mnt
mount -t tmpfs -o size=16m,mode=755 tmpfs "$new"
for d in usr bin sbin lib lib32 lib64 libx32 etc; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$new/$d"
  elif [ -d "/$d" ]; then
    mkdir "$new/$d"; mount --rbind "/$d" "$new/$d"; mount -o remount,bind,ro "$new/$d"
  fi
done
# Directories to hide that live inside those trees (a copy of Tether installed under /usr/local).
for d in "$@"; do
  if [ -d "$new$d" ] && [ ! -L "$new$d" ]; then mount -t tmpfs -o size=16m,mode=755,ro tmpfs "$new$d"; fi
done
mkdir -p "$new/dev" "$new/proc" "$new/tmp" "$new/.old"
for n in null zero random urandom; do
  touch "$new/dev/$n"; mount --bind "/dev/$n" "$new/dev/$n"
done
mount -t proc proc "$new/proc"
mount -t tmpfs -o size=16m,mode=1777 tmpfs "$new/tmp"
mkdir "$new/tmp/work"
mount --bind "$work" "$new/tmp/work"
cd "$new"
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,ro /
cd /tmp/work
ulimit -f %(fsize)d
exec unshare --user --mount --map-root-user -- env -i %(env)s bash -c "$TETHER_SANDBOX_COMMAND" 2>&1
"""


class SandboxUnavailable(RuntimeError):
    """The kernel refuses the namespaces the sandbox needs; nothing runs rather than running unguarded."""


@dataclass(frozen=True)
class Result:
    output: str
    returncode: int
    timed_out: bool
    truncated: bool


def hidden_dirs() -> list[str]:
    """Directories covered inside the sandbox: where tests, tasks, other rollouts and our code live."""
    import tether

    package_root = Path(tether.__file__).resolve().parent.parent
    dirs = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/root", "/home", str(Path.home()), os.getcwd()}
    dirs.add(str(package_root))
    # Every checkout of Tether on the import path (an editable install's too): its repository root.
    for entry in sys.path:
        if entry and (Path(entry) / "tether").is_dir():
            dirs.add(str(Path(entry).resolve().parent))
    if sys.prefix != sys.base_prefix:  # a virtualenv: its site-packages may hold an installed copy
        dirs.add(sys.prefix)
    dirs.update(os.environ.get("TETHER_SANDBOX_HIDE", "").split(os.pathsep))
    # Never cover a parent of the system's own tools.
    keep = ("/", "/usr", "/bin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/sys", "/mnt")
    return sorted(d for d in dirs if d and os.path.isabs(d) and os.path.normpath(d) not in keep)


def _prologue() -> str:
    env = " ".join(f"{k}={v}" for k, v in ENV.items())
    return _PROLOGUE % {"fsize": FILE_SIZE_LIMIT_KB, "env": env}


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(command: str, workdir: Path, timeout_s: float, output_limit: int) -> Result:
    """Run `command` with bash in the sandbox, cwd = `workdir` (seen as /tmp/work).

    Output (stdout and stderr together) beyond `output_limit` characters is dropped and the command
    killed; past `timeout_s` it is killed too (its whole PID namespace). Raises SandboxUnavailable.
    """
    check_available()
    argv = [
        "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--mount-proc",
        "--", "bash", "-c", _prologue(), "sandbox", str(workdir), *hidden_dirs(),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={"PATH": ENV["PATH"], "TETHER_SANDBOX_COMMAND": command},
        start_new_session=True,
    )
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    timed_out = truncated = False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not sel.select(left):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > output_limit * 4:  # utf-8: up to 4 bytes a character
                truncated = True
                break
    if timed_out or truncated:
        _kill(proc)
    proc.stdout.close()
    try:
        returncode = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill(proc)
        returncode = proc.wait()
    output = b"".join(chunks).decode("utf-8", errors="replace")
    if len(output) > output_limit:
        output, truncated = output[:output_limit], True
    return Result(output=output, returncode=returncode, timed_out=timed_out, truncated=truncated)


@functools.cache
def check_available() -> None:
    """SandboxUnavailable unless user, network, PID and mount namespaces can be made here (once)."""
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("the coding sandbox needs util-linux's unshare")
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        raise SandboxUnavailable(
            "the coding sandbox needs unprivileged user namespaces (unshare --user --net --mount --pid): "
            + probe.stderr.strip()
        )


def copy_files(src: Path, dst: Path, names: list[str], max_bytes: int = 65536) -> list[str]:
    """Copy the allow-listed regular files `names` from `src` into `dst`; the names copied.

    Symbolic links, directories, other files and anything bigger than `max_bytes` stay behind, so
    nothing the agent adds (conftest.py, sitecustomize.py, .pth files, links to elsewhere) travels.
    """
    copied = []
    for name in names:
        path = src / name
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            continue
        (dst / name).write_bytes(path.read_bytes())
        copied.append(name)
    return copied
