"""Root, apt and process helpers shared by the cluster fixtures (idempotent installs)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional, Sequence

APT_LOCK_TIMEOUT_S = 300


def is_root() -> bool:
    return os.geteuid() == 0


def run(cmd: Sequence[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise with that output."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def missing(commands: Sequence[str]) -> list[str]:
    return [c for c in commands if shutil.which(c) is None and not os.path.exists(c)]


_apt_updated = False


def apt_install(packages: Sequence[str], needed_commands: Sequence[str]) -> Optional[str]:
    """Install Debian packages unless every needed command is already there.

    Returns None when the commands are available, else the reason they are not (used as a
    pytest skip reason: not root, no apt-get, the install failed)."""
    global _apt_updated
    if not missing(needed_commands):
        return None
    if not is_root():
        return f"{', '.join(missing(needed_commands))} missing and not root to apt-get install {' '.join(packages)}"
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing(needed_commands))} missing and no apt-get to install {' '.join(packages)}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", f"DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"]
    try:
        if not _apt_updated:
            run(["apt-get", *lock, "update", "-qq"], timeout=600, env=env)
            _apt_updated = True
        run(["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", *packages],
            timeout=900, env=env)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return f"apt-get install {' '.join(packages)} failed: {str(e)[-800:]}"
    still = missing(needed_commands)
    if still:
        return f"after apt-get install {' '.join(packages)}, still missing: {', '.join(still)}"
    return None


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll predicate() until it is truthy; raise TimeoutError naming what we waited for."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Terminate a process we started (by its pid), then kill it if it lingers."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, grace: float = 5.0) -> None:
    """SIGTERM a daemon we started (by the pid it reported), SIGKILL if it lingers."""
    import signal
    if not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
