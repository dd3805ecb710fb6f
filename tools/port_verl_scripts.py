"""Copy the command lines of verl's own `main_ppo` example scripts into tests/fixtures/verl_examples/.

    python tools/port_verl_scripts.py [--mirror VERL_GIT_DIR] [--commit REV] [--out DIR]

Reads every `examples/**/*.sh` of a verl checkout (a bare git directory is enough: the files are read with
`git show REV:path`) that launches `python -m verl.trainer.main_ppo` (or `verl.trainer.main_ppo_sync`), and writes
one file per script, `DIR/<folder>__<name>.txt` (`examples/grpo_trainer/run_qwen3_8b_fsdp.sh` ->
`grpo_trainer__run_qwen3_8b_fsdp.txt`): a header of `# key: value` comment lines (source path, verl commit, the
launcher, `config-path` / `config-name` when the script passes Hydra's flags, what was substituted), then the
arguments main_ppo receives (its sys.argv[1:] less Hydra's --config-path/--config-name), one a line. Each line
is one shell word (raw, or quoted where the raw text would not read back as itself), so `shlex.split(line)`
gives the word back; tests/config/test_verl_example_scripts.py reads
the files and needs no verl checkout.

How a command line is expanded. verl's scripts are bash programs, not templates: their defaults come from
`${VAR:-default}`, assignments, `case "$DEVICE"` / `if [ "$INFER_BACKEND" = ... ]` branches, arrays
(`"${ACTOR[@]}"`), arithmetic (`$((a + b))`) and strings split on spaces (`$ACTOR_CONFIG`). Re-implementing that
would be a second, worse bash, so bash itself expands each script, as `bash examples/.../x.sh` started from
verl's repository root would, with nothing external able to run:

- the environment is empty: every `${VAR:-default}` takes the script's default. A variable the script reads
  without a default and never assigns (a scan of its text: `$HOME`, `$DATA_ROOT`, ...), or demands
  (`${MODEL_PATH:?set it}`), is set to the placeholder `__NAME__`; `$PWD` (verl's repository root) reads
  `__PWD__`. A script that reads a variable before the line giving it its default stops under `set -u` as
  written; that variable is set to that default (the value the script means) and the header says so.
- PATH holds no directory, so every external command goes to bash's `command_not_found_handle`, defined in the
  file BASH_ENV names (read by a non-interactive bash before the script). It captures the argument vector of
  the command that runs `-m verl.trainer.main_ppo[_sync]` (what stands before `-m`, `python3` or
  `uv run ... python3`, is the header's launcher); answers `date +FMT` for a fixed time, 2026-01-01 00:00:00
  UTC (experiment names carry dates); answers `dirname`; fails `python` / `python3` (the one probe the scripts
  run is `python3 -c 'import torch_npu'`: no Ascend NPU, so DEVICE=gpu as on a CUDA machine); and succeeds
  doing nothing for anything else (`mkdir`, `tee`, `hf download`, ...), each listed in the header as
  `# not run (stubbed): ...`. The builtin `ulimit` (raising the open-files limit fails unprivileged) is a
  function that does the same.

Each script runs from a temporary directory holding only that script at its path in verl's layout, so paths
relative to the script resolve as in verl's repository.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MIRROR = Path("/work/.mirror/verl-project+verl/repo")
DEFAULT_COMMIT = "1dda039"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "verl_examples"
ENTRY = re.compile(r"-m\s+verl\.trainer\.(main_ppo(?:_sync)?)\b")
FIXED_EPOCH = 1767225600  # 2026-01-01 00:00:00 UTC
# Variables bash sets itself (never placeholders).
BASH_VARS = {"BASH_SOURCE", "BASH_REMATCH", "BASHPID", "RANDOM", "LINENO", "SECONDS", "PWD", "OLDPWD", "PPID",
             "HOSTNAME", "UID", "EUID", "IFS", "PATH", "SHELL", "FUNCNAME", "PIPESTATUS", "OPTARG", "OPTIND"}

# The file BASH_ENV names: read by the non-interactive bash before the script runs.
PRELUDE = r"""
ulimit() { printf '%s\0' "ulimit $*" >> "$PORT_LOG"; }
command_not_found_handle() {  # runs in the child bash forks for the command: `set +x` ends there
    { set +x; } 2>/dev/null
    local argv=("$@") i
    for ((i = 0; i < ${#argv[@]}; i++)); do
        if [[ ${argv[i]} == -m && ${argv[i + 1]:-} == verl.trainer.main_ppo* ]]; then
            printf '%s\0' "${argv[@]}" > "$PORT_CAPTURE"
            return 0
        fi
    done
    printf '%s\0' "$*" >> "$PORT_LOG"
    case "$1" in
        date)
            if [[ ${2:-} == +* ]]; then printf "%(${2#+})T\n" "$PORT_EPOCH"; else printf '%(%c)T\n' "$PORT_EPOCH"; fi
            return 0 ;;
        dirname)
            if [[ ${2:-} == */* ]]; then printf '%s\n' "${2%/*}"; else printf '.\n'; fi
            return 0 ;;
        python | python3)
            return 1 ;;
    esac
    return 0
}
"""


def git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(mirror), *args], check=True, capture_output=True, text=True).stdout


def example_scripts(mirror: Path, commit: str) -> list[tuple[str, str]]:
    """(path, text) of every examples/**/*.sh at `commit` that launches verl.trainer.main_ppo[_sync]."""
    names = [n for n in git(mirror, "ls-tree", "-r", "--name-only", commit, "examples").splitlines()
             if n.endswith(".sh")]
    scripts = []
    for name in sorted(names):
        text = git(mirror, "show", f"{commit}:{name}")
        if ENTRY.search(text):
            scripts.append((name, text))
    return scripts


def fixture_name(path: str) -> str:
    """examples/grpo_trainer/run_qwen3_8b_fsdp.sh -> grpo_trainer__run_qwen3_8b_fsdp.txt"""
    parts = Path(path).with_suffix("").parts[1:]
    return "__".join(parts) + ".txt"


def unset_variables(text: str) -> list[str]:
    """Variables `text` reads without a default and never assigns (bash's own variables excepted), and those it
    demands with `${VAR:?message}`."""
    code = re.sub(r"(?m)^\s*#.*$", "", text)
    read = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)(?![A-Za-z0-9_])(?!:?[-=?+])", code))
    assigned = set(re.findall(r"(?m)(?:^|[\s;(])(?:export\s+|local\s+|declare\s+(?:-\w+\s+)*)?"
                              r"([A-Za-z_][A-Za-z0-9_]*)\+?=", code))
    assigned |= set(re.findall(r"\bfor\s+([A-Za-z_]\w*)\s+in\b", code))
    defaulted = set(re.findall(r"\$\{([A-Za-z_]\w*):?[-=]", code))
    required = set(re.findall(r"\$\{([A-Za-z_]\w*):?\?", code))  # `${VAR:?message}`: the script demands it
    return sorted((read - assigned - defaulted - BASH_VARS) | required)


def expand(path: str, text: str) -> tuple[list[str], list[str], list[str]]:
    """bash's expansion of the script: (argv of the main_ppo command, substitution notes, other commands run)."""
    preset = {name: f"__{name}__" for name in unset_variables(text)}
    notes = [f"${name} -> __{name}__ (read by the script with no default)" for name in preset]
    for _ in range(10):
        with tempfile.TemporaryDirectory(prefix="verl_port_") as tmp:
            tmp_path = Path(tmp)
            root = tmp_path / "verl"
            script = root / path
            script.parent.mkdir(parents=True)
            script.write_text(text)
            (tmp_path / "prelude.sh").write_text(PRELUDE)
            empty = tmp_path / "no_commands"
            empty.mkdir()
            capture, log = tmp_path / "argv", tmp_path / "log"
            env = {"PATH": str(empty), "BASH_ENV": str(tmp_path / "prelude.sh"), "TZ": "UTC", "LC_ALL": "C",
                   "PORT_CAPTURE": str(capture), "PORT_LOG": str(log), "PORT_EPOCH": str(FIXED_EPOCH), **preset}
            run = subprocess.run(["/bin/bash", path], cwd=root, env=env, capture_output=True, text=True,
                                 timeout=60)
            if capture.exists():
                argv = [w.replace(str(root), "__PWD__") for w in capture.read_bytes().decode().split("\0")[:-1]]
                others = log.read_bytes().decode().split("\0")[:-1] if log.exists() else []
                if any("__PWD__" in w for w in argv):
                    notes.append("$PWD (verl's repository root, where the script is started) -> __PWD__")
                return argv, notes, [o.replace(str(root), "__PWD__") for o in others]
        unbound = re.search(r"line \d+: ([A-Za-z_]\w*): unbound variable", run.stderr)
        if unbound is None or unbound.group(1) in preset:
            raise RuntimeError(f"{path}: bash exited {run.returncode} before main_ppo ran:\n{run.stderr[-3000:]}")
        # `set -u` and a variable read before the line that gives it its default (a slip in the script): set it
        # to that default, the value the script means, or to a placeholder where it has none.
        name = unbound.group(1)
        default = re.search(rf"(?m)^\s*{name}=\$\{{{name}:-([A-Za-z0-9_./-]*)\}}\s*$", text)
        preset[name] = default.group(1) if default else f"__{name}__"
        notes.append(f"${name} -> {preset[name]} (read before the line that gives it its default"
                     + (f" {preset[name]}" if default else "") + "; `set -u` stops the script as written)")
    raise RuntimeError(f"{path}: too many unbound variables")


def word_line(word: str) -> str:
    """One shell word that shlex.split reads back as `word`: raw where that works, else in double quotes where
    nothing in it is special there (verl's own spelling, `key="['a', 'b']"`), else shlex.quote'd."""
    if word and "\n" not in word and shlex.split(word) == [word]:
        line = word
    elif "\n" not in word and not any(c in word for c in '"\\$`'):
        line = f'"{word}"'
    else:
        line = shlex.quote(word)
    assert shlex.split(line) == [word], (word, line)
    return line


def render(path: str, commit: str, argv: list[str], notes: list[str], others: list[str]) -> str:
    at = next(i for i, w in enumerate(argv[:-1]) if w == "-m" and argv[i + 1].startswith("verl.trainer.main_ppo"))
    launcher, entry, args = argv[:at], argv[at + 1], argv[at + 2:]
    hydra: dict[str, str] = {}
    overrides: list[str] = []
    pending = None
    for word in args:
        if pending is not None:
            hydra[pending], pending = word, None
        elif word in ("--config-path", "--config-name", "-cp", "-cn"):
            pending = "config-path" if word in ("--config-path", "-cp") else "config-name"
        elif word.startswith(("--config-path=", "--config-name=")):
            key, value = word[2:].split("=", 1)
            hydra[key] = value
        else:
            overrides.append(word)
    lines = [
        f"# source: {path}",
        f"# verl: verl-project/verl {commit}",
        f"# entry: verl.trainer.{entry.rsplit('.', 1)[-1]}" if entry.startswith("verl.") else f"# entry: {entry}",
        f"# launcher: {shlex.join(launcher)}",
    ]
    lines += [f"# {key}: {value}" for key, value in sorted(hydra.items())]
    lines.append("# expanded: by bash, empty environment (every ${VAR:-default} is the script's default), "
                 "no torch_npu (a DEVICE probe gives gpu), date 2026-01-01 00:00:00 UTC")
    lines += [f"# substituted: {note}" for note in notes]
    stubbed = dict.fromkeys(" ".join(o.split()) for o in others if o.split() and o.split()[0] not in ("date", "dirname"))
    lines += [f"# not run (stubbed): {command[:110]}" for command in stubbed]
    return "\n".join(lines + [word_line(w) for w in overrides]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=DEFAULT_MIRROR, help="verl git directory (bare is fine)")
    parser.add_argument("--commit", default=DEFAULT_COMMIT)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    commit = git(args.mirror, "rev-parse", "--short=7", args.commit).strip()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.txt"):
        old.unlink()
    scripts = example_scripts(args.mirror, commit)
    for path, text in scripts:
        expanded = expand(path, text)
        (args.out / fixture_name(path)).write_text(render(path, commit, *expanded))
    print(f"{len(scripts)} scripts of verl {commit} -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
