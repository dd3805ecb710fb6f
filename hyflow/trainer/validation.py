"""The RL trainer's validation: generate for the whole validation set, score it, compute val-core / val-aux metrics.

`validate(trainer)` is `RLTrainer.validate`: it reads the trainer's validation set, actor group, reward manager,
tracker and step, and changes nothing of the training state.
"""

from __future__ import annotations

import torch

from hyflow.algos import compute_validation_metrics, reduce_metrics
from hyflow.trainer.report import sample_rows
from hyflow.trainer.tracking import dump_generations


def validation_order(size: int, shuffle: bool, seed: int) -> list[int]:
    """The order in which validation prompts are generated (data.validation_shuffle): file order, or a
    permutation drawn from a generator seeded with `seed` (data.seed or trainer.seed), the same at every
    validation of a run. Metrics cover the whole set either way; the order changes how prompts are batched."""
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def validate(trainer) -> dict[str, float]:
    """Generate for the whole validation set (val_kwargs), score, and compute val-core / val-aux metrics."""
    cfg = trainer.config
    ds = trainer.val_dataset
    size = cfg.data.val_batch_size or len(ds)
    params = trainer.sampling_params(validate=True, seed=cfg.trainer.seed)
    sources, uids, preds, rows, agent_metrics = [], [], [], [], []
    scores: dict[str, list] = {"reward": []}
    order = validation_order(len(ds), cfg.data.validation_shuffle, cfg.data.seed or cfg.trainer.seed)
    for start in range(0, len(ds), size):
        indices = order[start : start + size]
        prompts = ds.collate([ds[i] for i in indices])
        prompts["uid"] = [f"val-{i}" for i in indices]
        batch = trainer.actor.generate_sequences(prompts, params)
        agent_metrics.append(batch.meta.pop("metrics", {}))
        trainer.score(batch, trainer.val_reward_manager)
        seq_scores = batch["token_level_scores"].sum(-1).tolist()
        scores["reward"] += seq_scores
        extra_keys = [k for k in batch.keys() if k.startswith("reward_extra/")]  # noqa: SIM118 (iter = rows)
        for key in extra_keys:
            scores.setdefault(key.removeprefix("reward_extra/"), []).extend(batch[key])
        sources += list(batch["data_source"])
        uids += list(batch["uid"])
        preds += list(batch["reward_extra/pred"]) if "reward_extra/pred" in batch else [None] * len(batch)
        rows += sample_rows(batch, trainer.val_reward_manager.decode_responses(batch)[0], trainer.tokenizer)
    scores.pop("pred", None)
    trainer.tracker.log_generations(rows, step=trainer.global_step, split="val",
                                    max_table_rows=cfg.trainer.log_val_generations)
    if cfg.trainer.validation_data_dir:
        dump_generations(rows, cfg.trainer.validation_data_dir, trainer.global_step)
    has_preds = any(p is not None for p in preds)
    metrics = compute_validation_metrics(sources, uids, scores, preds if has_preds else None, seed=cfg.trainer.seed)
    # multi-turn: the agent loop's tool, turn, OpenAI-agent and environment metrics of the validation rollouts
    metrics.update({f"val-aux/{key}": value for key, value in reduce_metrics(agent_metrics).items()
                    if key.startswith(("tool/", "num_turns/", "openai/", "env/"))})
    return metrics
