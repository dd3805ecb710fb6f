"""What the RL trainer tells its user besides the per-step metrics: the start line on speed options, the rows of
generation logs and dumps, and where an interrupted run stands.

- `speed_defaults_line(cfg)`: the speed options whose hyflow default differs from verl's, as printed at start
  (docs/coming-from-verl.md);
- `sample_rows(batch, texts, tokenizer)`: one dict per sample (input, output, score, data_source, ground_truth,
  the scorer's extra columns), the rows of `trainer.log_val_generations` tables and of the rollout / validation
  data dumps;
- `latest_checkpoint(manager)`, `where_interrupted(...)`: the run directory's newest complete checkpoint, and the
  one line a Ctrl-C'd run prints about its step, its last checkpoint and how to resume.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from hyflow.batch import Batch
from hyflow.config import HyflowConfig
from hyflow.config.arithmetic import uses_critic
from hyflow.config.support import lookup
from hyflow.trainer.checkpoint import CheckpointManager

# Speed options whose hyflow default differs from verl's: (key, verl's default, what hyflow's value buys).
SPEED_DEFAULTS_VS_VERL = (
    ("actor_rollout_ref.actor.use_prefix_grouper", False, "same values and gradients, less compute"),
    ("critic.model.use_remove_padding", False, "same values and gradients, less compute"),
    ("actor_rollout_ref.actor.use_torch_compile", True, "no compile of seconds at start"),
)


def speed_defaults_line(cfg: HyflowConfig) -> str:
    """The start line naming the speed options that differ from verl's defaults here (docs/coming-from-verl.md)."""
    parts = []
    for key, verl_default, why in SPEED_DEFAULTS_VS_VERL:
        if key.startswith("critic.") and not uses_critic(cfg):
            continue
        value = lookup(cfg, key)
        if value != verl_default:
            parts.append(f"{key}={str(value).lower()} (verl: {str(verl_default).lower()}; {why})")
    return "speed options unlike verl's defaults: " + ("; ".join(parts) if parts else "none")


def sample_rows(batch: Batch, texts: list[str], tokenizer) -> list[dict]:
    """One dict per sample: input (the decoded prompt), output (`texts[i]`, the decoded response), score (summed
    token-level scores), data_source, ground_truth and the scorer's extra columns."""
    seq_scores = batch["token_level_scores"].sum(-1).tolist()
    extra = [k for k in batch.keys() if k.startswith("reward_extra/")]  # noqa: SIM118 (iter = rows)
    return [{"input": tokenizer.decode(batch["prompts"][i], skip_special_tokens=True), "output": text,
             "score": seq_scores[i], "data_source": batch["data_source"][i],
             "ground_truth": batch["ground_truth"][i] if "ground_truth" in batch else None,
             **{k.removeprefix("reward_extra/"): batch[k][i] for k in extra}}
            for i, text in enumerate(texts)]


def latest_checkpoint(manager: CheckpointManager) -> Path | None:
    """The run directory's newest complete checkpoint of this run, or None (with trainer.resume_mode=disable, a
    previous run's checkpoints in the directory are not this run's: `latest_step_of_this_run`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stale tracker file was reported when the run was claimed
        step = manager.latest_step_of_this_run()
    return None if step is None else manager.step_dir(step)


def where_interrupted(step: int, total_steps: int, last_checkpoint: Path | None,
                      manager: CheckpointManager | None) -> str:
    """Where an interrupted run stands: its step (`total_steps` 0: not set up yet), its last checkpoint (the one
    it saved, else the newest in the run directory) and how to resume from it."""
    where = f"during step {step} of {total_steps}" if total_steps else "at start"
    try:
        checkpoint = last_checkpoint or latest_checkpoint(manager)
    except Exception:  # interrupted before the run directory was set up
        checkpoint = None
    if checkpoint is None:
        return f"{where}; no checkpoint saved yet (trainer.save_freq), so running the command again starts over"
    return (f"{where}; last checkpoint: {checkpoint}; to resume from it, run the same command again "
            "(trainer.resume_mode=auto, the default)")
