"""Checkpoint storage: atomic, checksummed `global_step_N/` directories in the run directory.

Generic: `CheckpointManager` stores whatever named state it is given and knows nothing about RL. The
trainer passes e.g. `{"actor_model": model_sd, "actor_optimizer": optim_sd, "lr_scheduler": ...,
"rng": capture_rng_state(), "dataloader": loader.state_dict()}`.

Layout under the run directory (`trainer.default_local_dir`; verl's names where verl has them):

    latest_checkpointed_iteration.txt      the step of the newest checkpoint (verl's tracker file)
    global_step_N/
      manifest.json                        step, versions, time, components, and every file's size + sha256
      <name>.safetensors                   a component that is a flat {str: Tensor} dict (a model state dict)
      <name>.pt                            any other component (optimizer, scheduler, RNG, data-loader state)
      config.yaml                          the resolved run config, when given
      hf_config/                           config.json (+ generation_config.json) of the model, when given
      tokenizer/                           the tokenizer, when given
      huggingface/                         a full Hugging Face model directory, when `hf_model` is given
      <name>/                              a directory that a `sharded` writer filled (e.g. `actor/`: the
                                           torch.distributed.checkpoint shards every rank wrote), listed
                                           under "sharded" in the manifest and hashed like every other file

Atomic save. Everything is written into `.tmp_global_step_N_<pid>/`, every file is fsync'd and hashed,
`manifest.json` is written last, then the directory is renamed to `global_step_N` (one rename; a previous
`global_step_N` is moved aside to `.trash_global_step_N_<pid>` first and deleted only after the new one is
in place). The tracker file is then replaced with `os.replace`. So a crash at any point leaves either the
old state or the new one: never a half-written directory under a final name, never a lost checkpoint.
Leftover `.tmp_*` / `.trash_*` / `.deleting_*` directories are ignored by `list_steps` / `latest_step` and
cleaned by the next successful save (one process saves into a run directory at a time). A
`global_step_N` that has no `manifest.json` therefore did not come from a finished save.

Verification. "Complete" (what `list_steps` and `latest_step` accept) means: `manifest.json` parses and
every listed file exists with its recorded size. `verify` also recomputes every sha256 and raises
`CorruptCheckpointError` naming the directory, the problem and the fix.

Trust. Loading a checkpoint never runs code from it. Flat tensor dicts use safetensors; every other component
is read with `torch.load(weights_only=True)` (`hyflow.serialization.load_plain_data`), torch's restricted
unpickler that builds only tensors and plain containers (dict, list, tuple, str, numbers, None) and refuses any
other class or call: a crafted pickle is a `CheckpointSecurityError` naming the file, and nothing in it runs.
Components are therefore saved as plain data (the RNG snapshot stores NumPy's state as a tensor). The sha256
manifest guards against truncation and bit rot, not against an author who rewrites it.

Bit-exact resume. `capture_rng_state()` / `restore_rng_state()` cover Python's `random`, NumPy's global
generator, torch's CPU generator and every initialised CUDA device's generator; saved and restored with the
model, optimizer, scheduler and data-loader state, a resumed run draws the same random numbers as an
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hyflow.serialization import CheckpointSecurityError, load_plain_data  # noqa: F401 (re-exported)
from hyflow.trainer.rng_state import capture_rng_state, restore_rng_state  # noqa: F401 (re-exported)
from hyflow.version import distribution_version

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
STEP_PREFIX = "global_step_"
HF_MODEL_DIR = "huggingface"
HF_CONFIG_DIR = "hf_config"
TOKENIZER_DIR = "tokenizer"
CONFIG_YAML = "config.yaml"
MANIFEST_FORMAT = "hyflow-checkpoint"
MANIFEST_VERSION = 1

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(0|[1-9]\d*)$")
_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_LEFTOVER_PREFIXES = (".tmp_" + STEP_PREFIX, ".trash_" + STEP_PREFIX, ".deleting_" + STEP_PREFIX)
_KEY_ORDER_METADATA = "hyflow_key_order"
_HASH_CHUNK_BYTES = 8 << 20
_HASH_THREADS = min(8, os.cpu_count() or 1)
RESUME_MODES = ("auto", "disable", "resume_path")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory that is partial, truncated or altered after its save."""


class NotACheckpointError(ValueError):
    """A path that is not a checkpoint directory (e.g. the run directory that holds them)."""


# ------------------------------------------------------------------------------------------ files


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable; a no-op where directories cannot be opened."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path, *, fsync: bool = False) -> str:
    """sha256 of a file's bytes; with `fsync` the same pass makes the file durable (before the manifest
    names it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _hash_files(paths: list[Path], *, fsync: bool = False) -> list[str]:
    """`_sha256` of each path, in order; files hashed in parallel threads (hashlib releases the GIL on large
    buffers, so a checkpoint of many shard files hashes at the disk's speed, not one core's)."""
    if len(paths) <= 1:
        return [_sha256(p, fsync=fsync) for p in paths]
    workers = min(len(paths), _HASH_THREADS)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hyflow-sha256") as pool:
        return list(pool.map(lambda p: _sha256(p, fsync=fsync), paths))


def _write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _is_flat_tensor_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _tensors_for_safetensors(name: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that each own exactly their storage (safetensors refuses shared storage,
    e.g. tied embeddings); only tensors that need it are copied."""
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for key, tensor in state.items():
        if _is_dtensor(tensor):
            raise ValueError(
                f"component {name!r} key {key!r} is a DTensor shard; gather a full state dict first, e.g. "
                "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        owns_storage = storage.nbytes() == t.numel() * t.element_size()
        if not t.is_contiguous() or not owns_storage or (ptr != 0 and ptr in seen_storages):
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
            ptr = t.untyped_storage().data_ptr()
        seen_storages.add(ptr)
        out[key] = t
    return out


def _write_component(directory: Path, name: str, state: Any) -> dict[str, str]:
    """Write one component; a flat {str: Tensor} dict as safetensors, anything else with torch.save."""
    flat = _is_flat_tensor_dict(state)
    file = f"{name}.safetensors" if flat else f"{name}.pt"
    try:
        if flat:
            tensors = _tensors_for_safetensors(name, state)
            save_file(tensors, directory / file, metadata={_KEY_ORDER_METADATA: json.dumps(list(tensors))})
        else:
            torch.save(state, directory / file)
    except (OSError, RuntimeError) as exc:
        full = disk_full_error(exc, directory / file)
        if full is None:
            raise
        raise full from exc
    return {"file": file, "format": "safetensors" if flat else "torch"}


def disk_full_error(exc: BaseException, path: str | os.PathLike) -> OSError | None:
    """An `OSError(ENOSPC)` saying "no space left on device while writing PATH" for a write that failed because
    the device is full (an ENOSPC/EDQUOT OSError, or torch's `[enforce fail at inline_container.cc] unexpected
    pos` from a short write); None for any other failure."""
    import errno

    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        isinstance(exc, RuntimeError) and "inline_container" in text
        and ("unexpected pos" in text or "write failed" in text))
    if not full:
        return None
    return OSError(errno.ENOSPC, f"no space left on device while writing {path}; the previous checkpoint is "
                   "intact. Free space, or point trainer.default_local_dir at a larger disk, then resume", str(path))


def _read_component(directory: Path, entry: Mapping[str, str], map_location: str | torch.device) -> Any:
    path = directory / entry["file"]
    if entry["format"] == "safetensors":
        try:
            with safe_open(path, framework="pt", device=str(torch.device(map_location))) as f:
                metadata = f.metadata() or {}
                keys = json.loads(metadata[_KEY_ORDER_METADATA]) if _KEY_ORDER_METADATA in metadata else f.keys()
                return {key: f.get_tensor(key) for key in keys}
        except SafetensorError as e:
            first = (str(e).strip().splitlines() or ["SafetensorError"])[0]
            raise CorruptCheckpointError(
                f"{path} is not a readable safetensors file ({first}): the checkpoint was damaged or replaced after "
                "the save; resume or export from another checkpoint") from None
    return load_plain_data(path, map_location=map_location)


def _save_pretrained_dir(obj: Any, directory: Path, what: str, **kwargs: Any) -> None:
    if not hasattr(obj, "save_pretrained"):
        raise TypeError(
            f"{what} must have a save_pretrained(dir) method (a Hugging Face object); got {type(obj)}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    obj.save_pretrained(directory, **kwargs)


def _listed_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------ manifest


def step_dir_name(step: int) -> str:
    """`global_step_{step}` (verl's directory name)."""
    return f"{STEP_PREFIX}{step}"


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `manifest.json` of a checkpoint directory (raises CorruptCheckpointError if absent/invalid)."""
    directory = Path(path)
    problem, manifest = _manifest_problem(directory)
    if problem is not None:
        raise CorruptCheckpointError(_corrupt_message(directory, problem))
    return manifest


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step a checkpoint directory holds (from its manifest; verl reads it from the name)."""
    return int(read_manifest(path)["step"])


def _manifest_problem(directory: Path) -> tuple[str | None, dict[str, Any]]:
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"partial checkpoint (no {MANIFEST_FILE}: the save did not finish)", {}
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{MANIFEST_FILE} is unreadable ({e}): it was damaged after the save", {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    well_formed = (
        isinstance(files, dict)
        and all(isinstance(m, dict) and {"size", "sha256"} <= m.keys() for m in files.values())
        and isinstance(manifest.get("components"), dict)
        and "step" in manifest
    )
    if not well_formed:
        return (
            f"{MANIFEST_FILE} is malformed (needs 'step', 'components' and 'files' with size and sha256)",
            {},
        )
    return None, manifest


def _checkpoint_problem(directory: Path, *, checksums: bool) -> str | None:
    """What is wrong with a checkpoint directory, or None; sizes always, sha256 only with `checksums`."""
    if not directory.is_dir():
        return "the directory does not exist"
    problem, manifest = _manifest_problem(directory)
    if problem is not None:
        return problem
    for rel, meta in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            return f"missing file {rel} (listed in {MANIFEST_FILE})"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"size mismatch for {rel}: {size} bytes on disk, {meta['size']} in {MANIFEST_FILE} (truncated or overwritten)"
    if checksums:
        listed = list(manifest["files"].items())
        digests = _hash_files([directory / rel for rel, _ in listed])
        for (rel, meta), digest in zip(listed, digests, strict=True):
            if digest != meta["sha256"]:
                return (
                    f"checksum mismatch for {rel}: sha256 {digest[:16]}… on disk, {meta['sha256'][:16]}… in "
                    f"{MANIFEST_FILE} (the file's bytes changed after the save)"
                )
    return None


def _complete_steps(run_dir: Path) -> list[int]:
    if not run_dir.is_dir():
        return []
    steps = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and _checkpoint_problem(child, checksums=False) is None:
            steps.append(int(match.group(1)))
    return sorted(steps)


def _corrupt_message(directory: Path, problem: str) -> str:
    others = [s for s in reversed(_complete_steps(directory.parent)) if directory.name != step_dir_name(s)]
    if others:
        names = ", ".join(step_dir_name(s) for s in others)
        fix = f"delete it or resume from {step_dir_name(others[0])} (complete checkpoints beside it: {names})"
    else:
        fix = f"delete it (there is no other complete checkpoint in {directory.parent}; training starts from scratch)"
    return f"corrupt checkpoint {directory}: {problem}. Fix: {fix}"


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check a checkpoint directory against its manifest: every file present, sizes and sha256 equal.

    Raises FileNotFoundError if the directory is missing, CorruptCheckpointError naming the directory, the
    problem (partial checkpoint without manifest.json, missing file, size mismatch, checksum mismatch) and
    the fix (delete it or resume from another complete global_step_K).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not (directory / MANIFEST_FILE).exists():
        inner = _complete_steps(directory)
        if inner or (directory / TRACKER_FILE).exists():
            latest = f"; the latest complete one is {directory / step_dir_name(inner[-1])}" if inner else ""
            raise NotACheckpointError(
                f"{directory} is a run directory, not a checkpoint: pass one of its global_step_N directories{latest}")
        if not _STEP_DIR.match(directory.name):
            raise NotACheckpointError(f"{directory} is not a hyflow checkpoint (no {MANIFEST_FILE}); pass a "
                                      "RUN_DIR/global_step_N directory that a hyflow run saved")
    problem = _checkpoint_problem(directory, checksums=True)
    if problem is not None:
        raise CorruptCheckpointError(_corrupt_message(directory, problem))


# ------------------------------------------------------------------------------------------ manager


class CheckpointManager:
    """Saves, lists, verifies and loads `global_step_N/` checkpoints in one run directory.

    `max_to_keep`: after each successful save, delete the oldest complete checkpoints so at most this many
    remain (the one just saved always stays); None or 0 keeps all (verl's `max_*_ckpt_to_keep`).
    `save` may be called from a background thread (`checkpoint.async_save`): saves of one manager run one
    at a time.
    """

    def __init__(self, run_dir: str | os.PathLike, max_to_keep: int | None = None):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep < 0):
            raise ValueError(
                f"max_to_keep={max_to_keep!r} is invalid; use a positive number of checkpoints, or None/0 to keep all"
            )
        self.run_dir = Path(run_dir).expanduser()
        self.max_to_keep = max_to_keep or None
        self._save_lock = threading.Lock()
        self.saved_steps: list[int] = []  # the steps this manager saved, in order
        self.starts_over = False  # resolve_resume("disable"): the directory's checkpoints are a previous run's

    # -- paths

    @property
    def tracker_path(self) -> Path:
        return self.run_dir / TRACKER_FILE

    def step_dir(self, step: int) -> Path:
        """`run_dir/global_step_{step}`."""
        return self.run_dir / step_dir_name(step)

    def _as_dir(self, path_or_step: int | str | os.PathLike) -> Path:
        if isinstance(path_or_step, int) and not isinstance(path_or_step, bool):
            return self.step_dir(path_or_step)
        return Path(path_or_step).expanduser()

    # -- save

    def save(
        self,
        step: int,
        components: Mapping[str, Any],
        *,
        hf_model: Any = None,
        tokenizer: Any = None,
        hf_config: Any = None,
        generation_config: Any = None,
        config_yaml: str | None = None,
        hf_model_component: str = "actor_model",
        sharded: Mapping[str, Callable[[Path], Mapping[str, Any] | None]] | None = None,
    ) -> Path:
        """Write `run_dir/global_step_{step}/` atomically and point the tracker file at it; returns the path.

        components: name -> state. A non-empty flat {str: Tensor} dict (a model state dict) is written as
            `<name>.safetensors` (tied/shared tensors are stored once per key); anything else (optimizer,
            scheduler, RNG, data-loader state, plain dicts) with `torch.save` as `<name>.pt`. Tensors must
            be full, not DTensor shards.
        hf_model: a Hugging Face model (the component `hf_model_component`, the actor by default) also
            written as `huggingface/` with `save_pretrained` (safetensors), plus the tokenizer: a directory
            that `from_pretrained` loads (checkpoint.save_contents has `hf_model`).
        tokenizer: written to `tokenizer/` (and into `huggingface/` with `hf_model`).
        hf_config / generation_config: the model's `PretrainedConfig` / `GenerationConfig`, written to
            `hf_config/`, so `export_checkpoint` can rebuild the model without the base model directory.
        config_yaml: the resolved run config, written as `config.yaml`.
        sharded: name -> writer. Each writer is called with the (not yet existing) directory `<tmp>/<name>` and
            fills it, e.g. by having every rank write its shards there (the run directory must then be visible
            to every rank: one machine, or a shared filesystem); what it returns is recorded as the manifest's
            `sharded[name]` (with `dir`). The files are hashed like the others, so the checkpoint is atomic
            and verified as a whole.

        Sequence: write into `.tmp_global_step_{step}_<pid>/`, fsync + sha256 every file, write
        `manifest.json` last, rename into place (an existing `global_step_{step}` is moved aside first and
        deleted after), replace the tracker file, apply `max_to_keep`, delete leftovers of crashed saves.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        sharded = dict(sharded or {})
        for name in [*components, *sharded]:
            if not isinstance(name, str) or not _COMPONENT_NAME.match(name):
                raise ValueError(
                    f"component name {name!r} is not a valid file name; use letters, digits, '_', '-', '.' "
                    "(starting with a letter or digit), e.g. 'actor_model'"
                )
        extras = {
            "hf_model": hf_model,
            "tokenizer": tokenizer,
            "hf_config": hf_config,
            "generation_config": generation_config,
            "config_yaml": config_yaml,
            "hf_model_component": hf_model_component,
            "sharded": sharded,
        }
        reserved = {HF_MODEL_DIR, HF_CONFIG_DIR, TOKENIZER_DIR}
        clashes = sorted(set(sharded) & (reserved | {f"{n}.{ext}" for n in components for ext in ("pt", "safetensors")}))
        if clashes:
            raise ValueError(f"sharded directory name(s) {clashes} clash with the checkpoint's own files; rename them")
        with self._save_lock:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._recover_interrupted_replace()
            tmp = self.run_dir / f".tmp_{step_dir_name(step)}_{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            try:
                self._write_contents(tmp, step, components, **extras)
                final = self._move_into_place(tmp, step)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                full = disk_full_error(exc, tmp) if not getattr(exc, "filename", None) else None
                if full is not None:
                    raise full from exc
                raise
            self._write_tracker(step)
            self.saved_steps.append(step)
            self._apply_max_to_keep(keep=step)
            self._clean_leftovers()
        return final

    def _write_contents(
        self,
        tmp: Path,
        step: int,
        components: Mapping[str, Any],
        *,
        hf_model: Any,
        tokenizer: Any,
        hf_config: Any,
        generation_config: Any,
        config_yaml: str | None,
        hf_model_component: str,
        sharded: Mapping[str, Callable[[Path], Mapping[str, Any] | None]],
    ) -> None:
        entries = {name: _write_component(tmp, name, state) for name, state in components.items()}
        sharded_entries = {}
        for name, writer in sharded.items():
            info = dict(writer(tmp / name) or {})
            if not (tmp / name).is_dir() or not any((tmp / name).iterdir()):
                raise RuntimeError(f"the sharded writer for {name!r} wrote nothing into {tmp / name}")
            sharded_entries[name] = {"dir": name, **info}
        if config_yaml is not None:
            (tmp / CONFIG_YAML).write_text(config_yaml)
        if hf_config is not None:
            _save_pretrained_dir(hf_config, tmp / HF_CONFIG_DIR, "hf_config")
        if generation_config is not None:
            _save_pretrained_dir(generation_config, tmp / HF_CONFIG_DIR, "generation_config")
        if tokenizer is not None:
            _save_pretrained_dir(tokenizer, tmp / TOKENIZER_DIR, "tokenizer")
        if hf_model is not None:
            _save_pretrained_dir(hf_model, tmp / HF_MODEL_DIR, "hf_model", safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / HF_MODEL_DIR)
        paths = _listed_files(tmp)
        files = {
            path.relative_to(tmp).as_posix(): {"size": path.stat().st_size, "sha256": digest}
            for path, digest in zip(paths, _hash_files(paths, fsync=True), strict=True)
        }
        now = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "step": step,
            "hyflow_version": distribution_version(),
            "torch_version": torch.__version__,
            "saved_at": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "saved_at_unix": now,
            "components": entries,
            "huggingface": {"component": hf_model_component} if hf_model is not None else None,
            "sharded": sharded_entries,
            "files": files,
        }
        _write_text_durably(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
        for directory in sorted({p.parent for p in _listed_files(tmp)}, key=lambda p: -len(p.parts)):
            _fsync_dir(directory)

    def _move_into_place(self, tmp: Path, step: int) -> Path:
        final = self.step_dir(step)
        if not final.exists():
            os.rename(tmp, final)
            _fsync_dir(self.run_dir)
            return final
        trash = self.run_dir / f".trash_{step_dir_name(step)}_{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(trash, final)
            raise
        _fsync_dir(self.run_dir)
        shutil.rmtree(trash, ignore_errors=True)
        return final

    def _write_tracker(self, step: int) -> None:
        tmp = self.run_dir / f".{TRACKER_FILE}.tmp_{os.getpid()}"
        _write_text_durably(tmp, str(step))
        os.replace(tmp, self.tracker_path)
        _fsync_dir(self.run_dir)

    def _apply_max_to_keep(self, keep: int) -> None:
        if self.max_to_keep is None:
            return
        steps = self.list_steps()
        retained = set(steps[-self.max_to_keep :]) | {keep}
        for step in steps:
            if step not in retained:
                doomed = self.run_dir / f".deleting_{step_dir_name(step)}_{os.getpid()}"
                os.rename(self.step_dir(step), doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _recover_interrupted_replace(self) -> None:
        """A crash between the two renames of a same-step replace leaves the old checkpoint as
        `.trash_global_step_N_*` with no `global_step_N`: move it back."""
        if not self.run_dir.is_dir():
            return
        for child in sorted(self.run_dir.glob(f".trash_{STEP_PREFIX}*")):
            match = re.match(rf"^\.trash_{STEP_PREFIX}(\d+)_\d+$", child.name)
            final = self.step_dir(int(match.group(1))) if match else None
            if (
                final is not None
                and not final.exists()
                and _checkpoint_problem(child, checksums=False) is None
            ):
                os.rename(child, final)
                warnings.warn(
                    f"restored {final} from {child.name} (a save of that step was interrupted)", stacklevel=3
                )

    def _clean_leftovers(self) -> None:
        for child in self.run_dir.iterdir():
            if child.is_dir() and child.name.startswith(_LEFTOVER_PREFIXES):
                shutil.rmtree(child, ignore_errors=True)
        for child in self.run_dir.glob(f".{TRACKER_FILE}.tmp_*"):
            child.unlink(missing_ok=True)

    # -- list, latest, verify

    def list_steps(self) -> list[int]:
        """Steps of the complete checkpoints (manifest present, files present with their sizes), ascending."""
        return _complete_steps(self.run_dir)

    def _read_tracker(self) -> int | None:
        if not self.tracker_path.is_file():
            return None
        text = self.tracker_path.read_text().strip()
        try:
            return int(text)
        except ValueError:
            warnings.warn(f"{self.tracker_path} holds {text!r}, not a step number; ignoring it", stacklevel=3)
            return None

    def latest_step(self) -> int | None:
        """The step in `latest_checkpointed_iteration.txt` when that checkpoint is complete (verl semantics:
        the tracker decides, so editing it selects an older step); else, with a warning, the newest complete
        `global_step_*`; None when there is none."""
        complete = self.list_steps()
        tracked = self._read_tracker()
        if tracked is not None:
            problem = _checkpoint_problem(self.step_dir(tracked), checksums=False)
            if problem is None:
                return tracked
            complete = [s for s in complete if s != tracked]
            fallback = (
                f"falling back to {step_dir_name(complete[-1])}"
                if complete
                else "no complete checkpoint remains"
            )
            warnings.warn(
                f"{TRACKER_FILE} names step {tracked} but {self.step_dir(tracked)}: {problem}; {fallback}",
                stacklevel=2,
            )
        elif complete and not self.tracker_path.exists():
            warnings.warn(
                f"{self.tracker_path} is missing; using the newest complete checkpoint {self.step_dir(complete[-1])}",
                stacklevel=2,
            )
        return complete[-1] if complete else None

    def latest_step_of_this_run(self) -> int | None:
        """`latest_step()`, except for a run that started over (`resolve_resume("disable")`): the newest complete
        checkpoint this manager saved itself, or None (the directory's older checkpoints are a previous run's)."""
        if not self.starts_over:
            return self.latest_step()
        own = set(self.saved_steps).intersection(self.list_steps())
        return max(own) if own else None

    def verify(self, path_or_step: int | str | os.PathLike) -> None:
        """`verify_checkpoint` on `global_step_{step}` or a directory: sizes and sha256 against the manifest."""
        verify_checkpoint(self._as_dir(path_or_step))

    # -- load

    def load(
        self,
        path_or_step: int | str | os.PathLike,
        *,
        names: Iterable[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool = True,
    ) -> dict[str, Any]:
        """The saved components, name -> state (all of them, or only `names`).

        Safetensors components come back as plain {str: Tensor} dicts in their saved key order, on
        `map_location`; others via `load_plain_data` (tensors and plain containers only: no code runs).
        `verify` checks sizes and sha256 first (pass False right after `resolve_resume`, which verified).
        """
        directory = self._as_dir(path_or_step)
        if verify:
            verify_checkpoint(directory)
        elif not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
        entries = read_manifest(directory)["components"]
        wanted = list(entries) if names is None else list(names)
        unknown = [n for n in wanted if n not in entries]
        if unknown:
            raise KeyError(f"{directory} has no component(s) {unknown}; it holds {sorted(entries)}")
        return {name: _read_component(directory, entries[name], map_location) for name in wanted}

    def sharded_dirs(self, path_or_step: int | str | os.PathLike) -> dict[str, dict[str, Any]]:
        """name -> the manifest's entry for each sharded directory, with `path` (the directory) added."""
        directory = self._as_dir(path_or_step)
        entries = read_manifest(directory).get("sharded") or {}
        return {name: {**entry, "path": directory / entry["dir"]} for name, entry in entries.items()}

    # -- resume

    def resolve_resume(
        self, resume_mode: str, resume_from_path: str | os.PathLike | None = None
    ) -> Path | None:
        """The checkpoint to resume from (verified: sizes and sha256), or None to start from scratch.

        verl's `trainer.resume_mode`: `disable` -> None; `auto` -> the latest complete checkpoint in the
        run directory (the tracker's, else the newest; a corrupt one is skipped with a warning) or None;
        `resume_path` -> `resume_from_path` (absolute, relative to the working directory, or relative to the
        run directory), which must exist and verify.
        """
        if resume_mode not in RESUME_MODES:
            raise ValueError(f"trainer.resume_mode={resume_mode!r} is not one of {list(RESUME_MODES)}")
        if resume_mode == "disable":
            self.starts_over = True
            return None
        self._recover_interrupted_replace()
        if resume_mode == "auto":
            return self._latest_verified()
        return self._verified_resume_path(resume_from_path)

    def _latest_verified(self) -> Path | None:
        latest = self.latest_step()
        if latest is None:
            return None
        candidates = [latest] + [s for s in reversed(self.list_steps()) if s != latest]
        for step in candidates:
            problem = _checkpoint_problem(self.step_dir(step), checksums=True)
            if problem is None:
                return self.step_dir(step)
            warnings.warn(f"skipping corrupt checkpoint {self.step_dir(step)}: {problem}", stacklevel=3)
        return None

    def _verified_resume_path(self, resume_from_path: str | os.PathLike | None) -> Path:
        complete = ", ".join(str(self.step_dir(s)) for s in reversed(self.list_steps())) or "none"
        if resume_from_path is None or str(resume_from_path).strip() == "":
            raise ValueError(
                "trainer.resume_mode=resume_path needs trainer.resume_from_path=<run_dir>/global_step_N "
                f"(complete checkpoints in {self.run_dir}: {complete}); or use trainer.resume_mode=auto"
            )
        given = Path(resume_from_path).expanduser()
        path = (
            given
            if given.is_absolute() or given.exists() or not (self.run_dir / given).exists()
            else self.run_dir / given
        )
        if not path.is_dir():
            raise FileNotFoundError(
                f"trainer.resume_from_path={str(resume_from_path)!r} does not exist; point it at a global_step_N "
                f"directory (complete checkpoints in {self.run_dir}: {complete})"
            )
        if not (path / MANIFEST_FILE).exists():
            inner = _complete_steps(path)
            if inner:
                raise ValueError(
                    f"trainer.resume_from_path={str(resume_from_path)!r} is a run directory, not a checkpoint; "
                    f"point it at one of its global_step_N directories, e.g. {path / step_dir_name(inner[-1])}"
                )
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"trainer.resume_from_path={str(resume_from_path)!r}: {e}") from e
        return path.resolve()
