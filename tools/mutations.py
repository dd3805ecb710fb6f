"""The mutation check: break the core line of each feature on purpose and run the tests that must catch it.

    python tools/mutations.py [--fast] [--only ID ...] [--rotate N [--recent R]] [-j N] [--rev HEAD] [--baseline]
                              [--list] [--check]

The list is `tools/mutations.toml`: one `[[mutation]]` table per entry with `id`, `feature`, `file`, `original` (text
that must occur exactly once in `file`), `replacement`, `tests` (pytest node ids or paths), optionally `k` (a pytest
`-k` expression) and `timeout` (seconds), and `fast` (whether the tests are fast enough for `make test`).

The working tree is never touched: its files (tracked and untracked-not-ignored, or the commit `--rev` names) are
copied once per job into a temporary directory; each mutation is applied there, the tests run there with this
Python and `PYTHONPATH=<copy>` (checked once: the copy's `hyflow` must be the one imported), and the file gets its
original bytes back. Verdicts, from pytest's exit code:

    caught      1: a test failed
    NOT CAUGHT  0: every selected test passed with the mutant in place
    ERROR       anything else (2 interrupted or a collection error, 4 usage, 5 no tests collected), 0 with every
                selected test skipped, a timeout, an original that occurs 0 or several times, a replacement that
                does not compile

`--rotate N` (what `make test`, and so CI, runs: `--fast --rotate 6 --recent 10`) runs a share of the entries: those
whose position in the list is the checkout's slot modulo N (the slot: the number of commits on HEAD, or HEAD's hash
where the clone is shallow; so consecutive commits cycle through every entry every N commits), plus with `--recent R`
every entry whose `file` or test files a commit among the last R changed: the mutation that guards a line is run by
the commits that touch it. `make mutations` runs them all.

One line per mutation (`verdict  id  (file)  seconds  [failing test]`), then a summary; the exit code is 1 when any
mutation is not caught or errored. `--baseline` first runs each selection on the unmutated copy: a selection that
fails there cannot tell a mutant from a broken test, and is an ERROR.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tools" / "mutations.toml"
DEFAULT_TIMEOUT_S = 900
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider")
CAUGHT, NOT_CAUGHT, ERROR = "caught", "NOT CAUGHT", "ERROR"
REQUIRED = {"id": str, "feature": str, "file": str, "original": str, "replacement": str, "tests": list, "fast": bool}
OPTIONAL = {"k": str, "timeout": int}


_RUNNING: set[subprocess.Popen] = set()  # the pytest runs under way, each the leader of its own session
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()


class MutationError(Exception):
    """A list entry that cannot be applied or run as written."""


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One entry of the list: `original` in `file` becomes `replacement`; one of `tests` must then fail."""

    id: str
    feature: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    fast: bool
    k: str | None = None
    timeout: int = DEFAULT_TIMEOUT_S


@dataclasses.dataclass
class Result:
    mutation: Mutation
    verdict: str
    seconds: float
    detail: str = ""

    def line(self) -> str:
        return (f"{self.verdict:<10}  {self.mutation.id}  ({self.mutation.file})  {self.seconds:.0f} s"
                + (f"  {self.detail}" if self.detail else ""))


def load(path: Path = LIST) -> list[Mutation]:
    """The entries of a mutation list, each checked for its keys and their types; ids are unique."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise MutationError(f"{path}: not valid TOML ({exc})") from exc
    if set(data) - {"mutation"}:
        raise MutationError(f"{path}: unknown top-level keys {sorted(set(data) - {'mutation'})}; each entry is a "
                            "[[mutation]] table")
    mutations, seen = [], set()
    for n, entry in enumerate(data.get("mutation", []), 1):
        where = f"{path}: [[mutation]] #{n} ({entry.get('id', 'no id')})"
        missing = sorted(set(REQUIRED) - set(entry))
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if missing or unknown:
            raise MutationError(f"{where}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown keys {unknown} (valid: "
                                                                f"{sorted({**REQUIRED, **OPTIONAL})})"] if unknown else [])))
        for key, kind in {**REQUIRED, **OPTIONAL}.items():
            if key in entry and not isinstance(entry[key], kind):
                raise MutationError(f"{where}: {key} must be a {kind.__name__}, got {entry[key]!r}")
        if not entry["tests"] or not all(isinstance(t, str) and t for t in entry["tests"]):
            raise MutationError(f"{where}: tests must be a non-empty list of pytest node ids or paths")
        if entry["original"] == entry["replacement"]:
            raise MutationError(f"{where}: the replacement equals the original; a mutation must change the code")
        if entry["id"] in seen:
            raise MutationError(f"{where}: id {entry['id']!r} is used twice; ids must be unique")
        seen.add(entry["id"])
        mutations.append(Mutation(**{**entry, "tests": tuple(entry["tests"])}))
    if not mutations:
        raise MutationError(f"{path}: no [[mutation]] entries")
    return mutations


def mutate(mutation: Mutation, text: str) -> str:
    """`text` with the one occurrence of the mutation's original replaced; an error when it occurs 0 or >1 times."""
    count = text.count(mutation.original)
    if count != 1:
        raise MutationError(
            f"{mutation.id}: the original text occurs {count} times in {mutation.file} (it must occur exactly once); "
            + ("the code moved: find the line again and update tools/mutations.toml" if count == 0 else
               "add surrounding text to `original` (and `replacement`) until it is unique")
            + f"\n    original: {mutation.original!r}")
    mutated = text.replace(mutation.original, mutation.replacement)
    if mutation.file.endswith(".py"):
        try:
            compile(mutated, mutation.file, "exec")
        except SyntaxError as exc:
            raise MutationError(f"{mutation.id}: the mutant of {mutation.file} does not compile ({exc}); fix "
                                "`replacement`") from exc
    return mutated


def check(mutations: list[Mutation], root: Path) -> list[str]:
    """The problems that would stop a mutation from meaning anything at `root`: a file or test that does not exist,
    an original that does not occur exactly once, a mutant that does not compile."""
    problems = []
    for mutation in mutations:
        path = root / mutation.file
        if not path.is_file():
            problems.append(f"{mutation.id}: {mutation.file} does not exist")
            continue
        try:
            mutate(mutation, path.read_text())
        except MutationError as exc:
            problems.append(str(exc))
        for test in mutation.tests:
            file, _, name = test.partition("::")
            if not (root / file).exists():
                problems.append(f"{mutation.id}: test path {file} does not exist")
            elif name and not re.search(rf"def {re.escape(name.split('::')[-1].split('[')[0])}\(",
                                        (root / file).read_text()):
                problems.append(f"{mutation.id}: {file} has no test {name.split('[')[0]!r}")
    return problems


def copy_tree(root: Path, dest: Path, rev: str | None = None) -> None:
    """The files of `root`'s git checkout into `dest`: at commit `rev`, or the working tree's tracked and untracked
    (not ignored) files as they are now."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev is not None:
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=root, capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="tar")
        return
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
    for name in filter(None, listing.decode().split("\0")):
        source = root / name
        if source.is_file():  # a tracked file deleted in the working tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def child_env(copy: Path) -> dict[str, str]:
    """The environment of a run in `copy`: its own `hyflow` first on the path, and no bytecode written, so that a
    restored file is never shadowed by the mutant's cached bytecode (a same-size edit within the same second)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def copy_interpreter(copy: Path, python: str) -> str:
    """A venv beside `copy` whose Python finds the copy's packages first and then everything `python` has: its
    site-packages holds a .pth that puts the copy on sys.path ahead of `python`'s site-packages (whose editable
    install of the checkout then never wins). Tests that start `sys.executable` with a scrubbed environment or -I
    (the sandbox's tests do) so run the copy too, which PYTHONPATH alone would not reach."""
    venv = copy.parent / f"{copy.name}-venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True, timeout=300)
    new = str(venv / "bin" / "python")
    ask = "import site, sysconfig; print(sysconfig.get_paths()['purelib']); print(*site.getsitepackages(), sep='\\n')"
    purelib = subprocess.run([new, "-I", "-c", ask], capture_output=True, text=True, check=True).stdout.split()[0]
    old = subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, check=True).stdout.split()[1:]
    lines = [str(copy)] + [f"import site; site.addsitedir({path!r})" for path in old if Path(path).is_dir()]
    Path(purelib, "_hyflow_mutations_copy.pth").write_text("\n".join(lines) + "\n")
    return new


def verify_import(copy: Path, python: str, package: str = "hyflow") -> None:
    """Errors unless `python` imports `package` from `copy` (not from the editable install's checkout), both as the
    tests run it and as a test's subprocess with an empty environment in isolated mode (-I) does."""
    probe = f"import {package}; print({package}.__file__)"
    for args, env, cwd in (([python, "-c", probe], child_env(copy), copy), ([python, "-I", "-c", probe], {}, "/")):
        out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        found = out.stdout.strip()
        if out.returncode != 0 or not Path(found).resolve().is_relative_to(copy.resolve()):
            raise MutationError(f"in the copy {copy}, `{' '.join(args[:-2])}` imports {package} from "
                                f"{found or out.stderr[-500:]!r}, not from the copy: the mutants would not be what the "
                                f"tests run (is an installed {package} ahead of the copy on sys.path?)")


def failing_test(output: str) -> str:
    """The first test pytest's short summary names as failed (or errored), '' when none."""
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return match.group(1) if match else ""


def pytest_command(mutation: Mutation, python: str, basetemp: Path) -> list[str]:
    return [python, "-m", "pytest", *PYTEST_ARGS, f"--basetemp={basetemp}", *mutation.tests,
            *(["-k", mutation.k] if mutation.k else [])]


def run_tests(mutation: Mutation, copy: Path, python: str) -> tuple[int | None, str]:
    """pytest's exit code (None after the mutation's timeout) and its output, run in `copy` in a session of its
    own, so that a timeout ends every process the tests started."""
    basetemp = copy.parent / f"{copy.name}-pytest"
    proc = subprocess.Popen(pytest_command(mutation, python, basetemp), cwd=copy, env=child_env(copy),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
        if _STOPPING.is_set():  # started while stop_all() ran
            _kill(proc)
    try:
        output, _ = proc.communicate(timeout=mutation.timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        return None, output
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
        shutil.rmtree(basetemp, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of `proc`'s session (the tests' own subprocesses, ranks and Ray included)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_all() -> None:
    """End every pytest run under way, and any that starts after (an interrupted check leaves nothing running)."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        for proc in _RUNNING:
            _kill(proc)


def run_one(mutation: Mutation, copy: Path, python: str, baseline: bool = False) -> Result:
    """Apply `mutation` in `copy`, run its tests, put the file's original bytes back; the verdict."""
    start = time.perf_counter()
    path = copy / mutation.file
    try:
        original = path.read_bytes()
        mutated = mutate(mutation, original.decode())
    except (OSError, MutationError) as exc:
        return Result(mutation, ERROR, time.perf_counter() - start, str(exc).splitlines()[0])
    if baseline:
        rc, output = run_tests(mutation, copy, python)
        if rc != 0:
            return Result(mutation, ERROR, time.perf_counter() - start,
                          f"the tests fail without the mutant (exit {rc}) {failing_test(output)}".rstrip())
    try:
        path.write_bytes(mutated.encode())
        rc, output = run_tests(mutation, copy, python)
    finally:
        path.write_bytes(original)
    seconds = time.perf_counter() - start
    if rc == 1:
        return Result(mutation, CAUGHT, seconds, failing_test(output))
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if rc == 0 and "skipped" in last and "passed" not in last:  # nothing ran: it proves nothing either way
        return Result(mutation, ERROR, seconds, f"every selected test was skipped ({last.strip('= ')})")
    if rc == 0:
        return Result(mutation, NOT_CAUGHT, seconds)
    if rc is None:
        return Result(mutation, ERROR, seconds, f"timed out after {mutation.timeout} s")
    return Result(mutation, ERROR, seconds, f"pytest exit {rc}: {last}")


def run_all(mutations: list[Mutation], root: Path, *, jobs: int = 1, rev: str | None = None,
            python: str = sys.executable, baseline: bool = False, echo=print) -> list[Result]:
    """Every mutation in a copy of `root` (one copy per job), `echo`ing each verdict line as it comes; the results
    in list order."""
    jobs = max(1, min(jobs, len(mutations)))
    _STOPPING.clear()
    with tempfile.TemporaryDirectory(prefix="hyflow-mutations-") as tmp:
        pythons = {}  # copy -> its interpreter
        for j in range(jobs):
            copy = Path(tmp) / f"copy{j}"
            copy_tree(root, copy, rev)
            pythons[copy] = copy_interpreter(copy, python)
            verify_import(copy, pythons[copy])
        free, lock = list(pythons), threading.Lock()

        def job(mutation: Mutation) -> Result:
            with lock:
                copy = free.pop()
            try:
                result = run_one(mutation, copy, pythons[copy], baseline)
            finally:
                with lock:
                    free.append(copy)
            echo(result.line())
            return result

        pool = concurrent.futures.ThreadPoolExecutor(jobs)
        try:
            return [future.result() for future in [pool.submit(job, m) for m in mutations]]
        except BaseException:  # Ctrl-C, SIGTERM: the runs are in sessions of their own, no signal reaches them
            stop_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def summary(results: list[Result], seconds: float) -> str:
    counts = {v: sum(r.verdict == v for r in results) for v in (CAUGHT, NOT_CAUGHT, ERROR)}
    return (f"{len(results)} mutations: {counts[CAUGHT]} caught, {counts[NOT_CAUGHT]} not caught, "
            f"{counts[ERROR]} errors in {seconds:.0f} s")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def rotation(mutations: list[Mutation], root: Path, every: int, recent: int) -> tuple[list[Mutation], str]:
    """`--rotate every --recent recent`: the entries of this checkout's slot, plus those whose file or tests the last
    `recent` commits changed (see the module docstring); and a line saying which and why."""
    shallow = _git(root, "rev-parse", "--is-shallow-repository") == "true"
    slot = int(_git(root, "rev-parse", "HEAD"), 16) if shallow else int(_git(root, "rev-list", "--count", "HEAD"))
    slot %= every
    changed: set[str] = set()
    history = "none: a shallow clone"
    if recent > 0 and not shallow:
        commits = min(recent, int(_git(root, "rev-list", "--count", "HEAD")) - 1)
        if commits > 0:
            changed = set(_git(root, "diff", "--name-only", f"HEAD~{commits}", "HEAD").splitlines())
        history = f"{commits} commits"

    def touched(m: Mutation) -> bool:
        return m.file in changed or any(test.split("::")[0] in changed for test in m.tests)

    chosen = [m for i, m in enumerate(mutations) if i % every == slot or touched(m)]
    in_slot = sum(1 for i in range(len(mutations)) if i % every == slot)
    line = (f"mutations: {len(chosen)} of {len(mutations)} entries: slot {slot} of {every} ({in_slot} entries) and "
            f"{len(chosen) - in_slot} more whose file or tests changed in the last {history}; "
            "`make mutations` runs every entry")
    return chosen, line


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check the list against the working tree (files, originals, tests exist) and exit")
    parser.add_argument("--fast", action="store_true", help="only the entries marked fast = true")
    parser.add_argument("--only", nargs="+", metavar="ID", help="only these ids")
    parser.add_argument("--rotate", type=int, metavar="N", help="only this checkout's slot of N (module docstring)")
    parser.add_argument("--recent", type=int, default=0, metavar="R",
                        help="with --rotate: also every entry whose file or tests the last R commits changed")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutations run side by side, each in its copy")
    parser.add_argument("--rev", help="copy this commit (git archive) instead of the working tree's files")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each selection unmutated: one that fails there is an ERROR")
    parser.add_argument("--file", type=Path, default=LIST, help=f"the mutation list (default {LIST.relative_to(ROOT)})")
    parser.add_argument("--root", type=Path, default=ROOT, help="the git checkout to copy (default this one)")
    args = parser.parse_args(argv)
    try:
        mutations = load(args.file)
    except MutationError as exc:
        print(f"mutations: {exc}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutations})
        if unknown:
            print(f"mutations: no entries {unknown} in {args.file}; --list shows the ids", file=sys.stderr)
            return 2
        mutations = [m for m in mutations if m.id in args.only]
    if args.fast:
        mutations = [m for m in mutations if m.fast]
    if args.rotate is not None:
        if args.rotate < 1:
            print(f"mutations: --rotate {args.rotate} must be >= 1", file=sys.stderr)
            return 2
        mutations, line = rotation(mutations, args.root, args.rotate, args.recent)
        print(line, flush=True)
    if args.list:
        for m in mutations:
            print(f"{m.id:<34} {'fast' if m.fast else 'slow'}  {m.file}  {m.feature}\n{'':<40}{' '.join(m.tests)}"
                  + (f" -k {m.k!r}" if m.k else ""))
        return 0
    if args.check:
        problems = check(mutations, args.root)
        for problem in problems:
            print(problem)
        print(f"{len(mutations)} mutations checked: {len(problems)} problems")
        return 1 if problems else 0
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        results = run_all(mutations, args.root, jobs=args.jobs, rev=args.rev, baseline=args.baseline,
                          echo=lambda line: print(line, flush=True))
    except MutationError as exc:
        print(f"mutations: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mutations: interrupted; the pytest runs under way were ended, the copies removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary(results, time.perf_counter() - start))
    return 0 if all(r.verdict == CAUGHT for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
