"""The sandbox keeps the interpreter it runs readable wherever it lives (a real venv under /tmp, reached through a
symlink), hides what lies beside it, and `sandbox_guarantees()` reports only what its probe program observed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from hyflow.rewards import sandbox

REPO = Path(__file__).resolve().parents[2]

# Runs under the venv's interpreter: three sandboxed calls and the guarantees, printed as JSON.
DRIVER = textwrap.dedent(
    r"""
    import json, os, sys
    from hyflow.rewards import sandbox
    real, secret = sys.argv[1], sys.argv[2]
    site = os.path.join(real, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    calls = {
        "import": "import hyflow_venv_probe\nprint(hyflow_venv_probe.VALUE)",
        "prefix": f"print(open({os.path.join(real, 'pyvenv.cfg')!r}).read().count('home'))",
        "secret": f"print(open({secret!r}).read())",
        "write": f"open({os.path.join(site, 'planted.pth')!r}, 'w').write('import os')\nprint('WROTE')",
    }
    out = {name: sandbox.run_code(code, timeout_s=20).__dict__ for name, code in calls.items()}
    out = {name: {key: value for key, value in result.items() if key != "protections"} for name, result in out.items()}
    out["prefix_seen"] = sys.prefix
    out["guarantees"] = sandbox.sandbox_guarantees()
    print(json.dumps(out))
    """
)


def _strongest_mode() -> None:
    held = sandbox.sandbox_guarantees()
    for name in ("private size-limited /tmp, /dev/shm and working directory", "read-only filesystem"):
        if not held[name]:
            pytest.skip(f"the sandbox cannot guarantee '{name}' on this machine (see the warning it logged)")


@pytest.fixture
def venv_under_tmp():
    """(a venv under /tmp reached through a symlink, its real path, a secret beside it in the same folder).

    A real venv (`python -m venv --without-pip`, a fraction of a second) whose site-packages holds one module;
    a `.pth` there gives the venv's interpreter hyflow and its dependencies (the trainer side only: the sandbox
    runs no `.pth` file)."""
    top = Path(tempfile.mkdtemp(prefix="hyflow_venv_", dir="/tmp"))
    try:
        os.chmod(top, 0o755)  # the sandbox may run as a fresh uid: only the hiding may stop it
        real = top / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(real)], check=True, timeout=120)
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        site = real / "lib" / version / "site-packages"
        (site / "hyflow_venv_probe.py").write_text("VALUE = 42\n")
        (site / "hyflow_deps.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{REPO}\n")
        for path in (site / "hyflow_venv_probe.py", site / "hyflow_deps.pth"):
            os.chmod(path, 0o644)
        secret = top / "secret.txt"
        secret.write_text("TOKEN-beside-the-venv\n")
        os.chmod(secret, 0o644)
        (top / "link").symlink_to("venv")
        yield top / "link", real, secret
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_venv_under_tmp_through_a_symlink_stays_importable_and_its_neighbour_hidden(venv_under_tmp):
    """Failed before: the sandbox bound the venv's site-packages back into its private /tmp at the real path,
    while the solution's sys.path named the symlinked one (ModuleNotFoundError for every package of the venv),
    and `sandbox_guarantees()` still reported every guarantee held."""
    _strongest_mode()
    link, real, secret = venv_under_tmp
    process = subprocess.run(
        [str(link / "bin" / "python"), "-c", DRIVER, str(real), str(secret)],
        capture_output=True, text=True, timeout=300, cwd="/",
    )
    assert process.returncode == 0, process.stderr
    out = json.loads(process.stdout.strip().splitlines()[-1])
    assert out["prefix_seen"] == str(link)  # the interpreter under test runs as the venv through its link
    assert out["import"]["status"] == "ok" and out["import"]["stdout"] == "42\n", out["import"]
    assert out["prefix"]["status"] == "ok" and out["prefix"]["stdout"] == "1\n", out["prefix"]  # the prefix: readable
    assert out["secret"]["status"] == "error" and "TOKEN" not in out["secret"]["stdout"], out["secret"]
    assert "FileNotFoundError" in out["secret"]["stderr"]  # hidden, not just unreadable
    assert "WROTE" not in out["write"]["stdout"], out["write"]  # read-only
    assert not (real / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "planted.pth").exists()
    assert all(out["guarantees"].values()), out["guarantees"]


def _lying_report(monkeypatch) -> None:
    """Every run reports every mechanism, whatever held: only the probe can tell."""
    every = frozenset(mechanism for mechanisms in sandbox.GUARANTEES.values() for mechanism in mechanisms)
    real_read = sandbox._read_report
    monkeypatch.setattr(sandbox, "_read_report", lambda report_r, notes: real_read(report_r, notes) | every)
    monkeypatch.setattr(sandbox, "_guarantees_cache", None)


def test_a_guarantee_is_held_only_when_the_probe_shows_it(monkeypatch):
    _strongest_mode()
    _lying_report(monkeypatch)
    monkeypatch.setattr(sandbox, "_DISABLED_MECHANISMS", frozenset({"filesystem"}))  # the host's files, writable
    held = sandbox.sandbox_guarantees()
    for name in ("read-only filesystem", "private size-limited /tmp, /dev/shm and working directory",
                 "home directories and credentials hidden"):
        assert held[name] is False, (name, held)
    assert held["no sockets"] and held["the interpreter's standard library and site-packages importable"]


def test_sockets_without_seccomp_are_caught_by_the_probe(monkeypatch):
    _strongest_mode()
    _lying_report(monkeypatch)
    monkeypatch.setattr(sandbox, "_DISABLED_MECHANISMS", frozenset({"seccomp", "namespaces"}))
    held = sandbox.sandbox_guarantees()
    assert held["no sockets"] is False, held
