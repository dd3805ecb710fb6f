"""Rollout replay: train on the rollouts a run wrote, without generating (slime's `--debug-train-only`).

With `trainer.rollout_data_dir=DIR` the trainer writes, beside verl's `<step>.jsonl` dump, the scored rollout batch
of every step exactly as the training stages receive it: `<step>.rollout.safetensors` (every tensor: prompts,
responses, masks, rollout log-probs, token-level scores, ...) and `<step>.rollout.json` (the object columns:
uids, data sources, ground truths, reward extras; the batch's meta; the rollout stage's metrics).

`trainer.replay_rollouts=DIR` then takes each step's batch from there instead of generating and scoring it: the
same batches reach the same log-prob, advantage and update code, so with the same config and seed the losses and
the weights match the original run step by step (tests/trainer/test_replay.py), and a training-side bug can be
debugged without the rollout engine, the reward functions or their cost. The data loader still advances (epochs and
resume stay where they were) and validation still generates.

Both files are read without running code: tensors through safetensors, the rest as JSON (object columns come back
as JSON values: tuples as lists, NumPy scalars as numbers).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hyflow.batch import Batch
from hyflow.trainer.tracking import json_safe

FORMAT = "hyflow-rollout-1"
SUFFIX = ".rollout"


def rollout_paths(directory: str | os.PathLike, step: int) -> tuple[Path, Path]:
    """(`<step>.rollout.safetensors`, `<step>.rollout.json`) in `directory`."""
    base = Path(directory).expanduser() / f"{int(step)}{SUFFIX}"
    return base.with_name(base.name + ".safetensors"), base.with_name(base.name + ".json")


def save_rollout(batch: Batch, metrics: Mapping[str, Any], directory: str | os.PathLike, step: int) -> Path:
    """Write the scored rollout batch of `step` and the rollout stage's `metrics`; each file replaced atomically.
    Returns the JSON file's path."""
    tensor_path, json_path = rollout_paths(directory, step)
    tensor_path.parent.mkdir(parents=True, exist_ok=True)
    keys, tensors = [], {}
    for i, (key, value) in enumerate(batch.tensors.items(include_nested=True, leaves_only=True)):
        keys.append(list(key) if isinstance(key, tuple) else [key])
        tensors[str(i)] = value.detach().cpu().contiguous()
    tmp = tensor_path.with_name(f".{tensor_path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, tensor_path)
    record = {"format": FORMAT, "step": int(step), "length": len(batch), "tensor_keys": keys,
              "non_tensors": {k: json_safe(list(v)) for k, v in batch.non_tensors.items()},
              "meta": json_safe(batch.meta), "metrics": json_safe(dict(metrics))}
    tmp = json_path.with_name(f".{json_path.name}.tmp")
    tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, json_path)
    return json_path


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The steps whose rollout `directory` holds (both files present), ascending."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"(\d+)\.rollout\.json", p.name))]
    return sorted(s for s in steps if rollout_paths(folder, s)[0].is_file())


def load_rollout(directory: str | os.PathLike, step: int) -> tuple[Batch, dict[str, Any]]:
    """The batch and the rollout metrics `save_rollout` wrote for `step`; a missing or damaged file is a
    ValueError that names it, the steps the directory holds and the fix."""
    tensor_path, json_path = rollout_paths(directory, step)
    if not json_path.is_file() or not tensor_path.is_file():
        have = saved_steps(directory)
        held = (f"it holds the rollouts of steps {_ranges(have)}" if have else
                "it holds no rollouts (<step>.rollout.json and .safetensors)")
        raise ValueError(f"trainer.replay_rollouts={directory}: no rollout for step {step} ({json_path.name} and "
                         f"{tensor_path.name}); {held}. Replay needs the trainer.rollout_data_dir of a run with "
                         "the same data.train_batch_size and rollout.n, over the steps you train")
    try:
        record = json.loads(json_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{json_path} is not readable JSON ({err}): the file is damaged; write the rollouts "
                         "again with trainer.rollout_data_dir") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{json_path} is not a hyflow rollout file (format {FORMAT}); write the rollouts with "
                         "trainer.rollout_data_dir")
    try:
        flat = load_file(str(tensor_path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{tensor_path} is not a readable safetensors file ({err}): the file is damaged; write "
                         "the rollouts again with trainer.rollout_data_dir") from None
    tensors: dict[str, Any] = {}
    for i, key in enumerate(record["tensor_keys"]):
        if str(i) not in flat:
            raise ValueError(f"{tensor_path} lacks the tensor {'.'.join(key)!r} that {json_path.name} lists: the "
                             "two files are from different saves; write the rollouts again")
        node = tensors
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = flat[str(i)]
    batch = Batch(tensors, record["non_tensors"], record["meta"])
    if len(batch) != record["length"]:
        raise ValueError(f"{json_path}: {len(batch)} samples where the file says {record['length']}")
    return batch, dict(record["metrics"])


def check_replay_shape(batch: Batch, *, samples: int, directory: str | os.PathLike, step: int) -> None:
    """A replayed batch must have the step's sample count (train_batch_size x rollout.n) unless dynamic sampling
    trimmed it; anything else is a ValueError naming both."""
    if len(batch) != samples:
        raise ValueError(f"trainer.replay_rollouts={directory}: the rollout of step {step} holds {len(batch)} "
                         f"samples, this run's steps take {samples} (data.train_batch_size x rollout.n): replay "
                         "with the batch sizes of the run that wrote it")


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(f"{start}-{s}" if s != start else str(s))
            start = None
    return ", ".join(parts)
