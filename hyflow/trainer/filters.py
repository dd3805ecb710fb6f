"""Batch filters: which samples of a step train, composed from the config (`build_filters`).

Each filter is a `BatchFilter`, a callable `filter(batch, metrics, step) -> batch` with a `stage`:

- `rollout`: each generation round's scored batch (`RLTrainer.rollout_and_score`). PRIME's prompt filter
  (`data.oversample_factor`: keep `train_batch_size` of the oversampled prompts, those passing the accuracy /
  truncation filter first) and DAPO's dynamic sampling (`algorithm.filter_groups`: drop prompts whose samples
  all scored the same). A filter that `refills` makes the trainer generate more rounds until `full` returns the
  batch (`fill_batch`);
- `advantages`: the batch after the advantages (`RLTrainer.filter_policy`): PF-PPO's resampling by score
  (`algorithm.use_pf_ppo`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hyflow.algos import masked_sum, pf_ppo_resample_indices
from hyflow.batch import Batch
from hyflow.config import HyflowConfig


class BatchFilter:
    """A batch filter: `filter(batch, metrics, step) -> batch` at `stage` ("rollout" or "advantages"); one that
    `refills` also has `full(kept, rounds, metrics)`: the step's batch once the rounds `kept` suffice, else None."""

    stage = "rollout"
    refills = False

    def __call__(self, batch: Batch, metrics: dict, step: int) -> Batch:
        raise NotImplementedError


@dataclass(frozen=True)
class PromptFilter(BatchFilter):
    """verl-recipe prime's `filter_and_downsample`: of the oversampled prompts keep `keep` (data.train_batch_size),
    those passing the filters first (`accuracy`: mean score in [lower, upper]; `truncate`: no sample reached
    `response_length` - 1 tokens), each part in generation order. Metrics: `acc` (verl's: the mean score of every
    generated sample) and `train/filter_pass_share`."""

    keep: int
    n: int
    response_length: int
    accuracy: bool
    lower: float
    upper: float
    truncate: bool

    def __call__(self, batch: Batch, metrics: dict, step: int) -> Batch:
        scores = masked_sum(batch["token_level_scores"], batch["response_mask"], dim=-1)
        rows: dict = {}  # uid -> its rows, in generation order (one pass: the batch holds thousands of rows)
        for i, uid in enumerate(batch["uid"]):
            rows.setdefault(uid, []).append(i)
        order = list(rows)
        lengths = batch["response_mask"].sum(-1)
        passes = {}
        for uid in order:
            ok = True
            if self.accuracy:
                mean = float(scores[rows[uid]].mean())
                ok = self.lower <= mean <= self.upper
            if self.truncate:
                ok = ok and int(lengths[rows[uid]].max()) < self.response_length - 1
            passes[uid] = ok
        chosen = ([uid for uid in order if passes[uid]] + [uid for uid in order if not passes[uid]])[: self.keep]
        metrics["acc"] = float(scores.mean())
        metrics["train/filter_pass_share"] = sum(passes.values()) / max(len(order), 1)
        keep = torch.tensor([i for uid in chosen for i in rows[uid]], dtype=torch.long)
        if len(keep) != self.keep * self.n:
            raise RuntimeError(f"data.oversample_factor: {len(order)} prompts of {self.n} samples were generated, "
                               f"fewer than data.train_batch_size={self.keep}")
        return batch[keep]


def keep_varied_groups(batch: Batch, metric: str | None) -> Batch:
    """DAPO dynamic sampling: drop prompts whose samples all got the same `metric` (no learning signal)."""
    key = f"reward_extra/{metric}" if metric and metric not in ("score", "seq_final_reward") else None
    values = (np.asarray(batch[key], dtype=float) if key else batch["token_level_scores"].sum(-1).numpy())
    uids = list(batch["uid"])
    by_uid: dict = {}
    for uid, value in zip(uids, values):
        by_uid.setdefault(uid, []).append(value)
    varied = {uid for uid, vals in by_uid.items() if np.std(vals) > 0 or len(vals) == 1}
    return batch[np.array([uid in varied for uid in uids], dtype=bool)]


@dataclass(frozen=True)
class DynamicSampling(BatchFilter):
    """DAPO's dynamic sampling (algorithm.filter_groups): each round keeps the prompts whose samples differ in
    `metric`; rounds are generated until `wanted` prompts are kept (at most `max_rounds`; 0 = no limit)."""

    metric: str | None
    wanted: int
    n: int
    max_rounds: int
    refills = True

    def __call__(self, batch: Batch, metrics: dict, step: int) -> Batch:
        return keep_varied_groups(batch, self.metric)

    def full(self, kept: list[Batch], rounds: int, metrics: dict) -> Batch | None:
        """The step's batch once the rounds `kept` hold `wanted` prompts, else None (another round)."""
        have = sum(len(b) for b in kept) // self.n
        metrics["train/num_gen_batches"] = rounds
        if have >= self.wanted:
            return Batch.concat(kept)[: self.wanted * self.n]
        if 0 < self.max_rounds <= rounds:
            raise RuntimeError(f"dynamic sampling kept {have} of {self.wanted} prompts after {rounds} generation "
                               "rounds (algorithm.filter_groups.max_num_gen_batches); the task is too easy or too "
                               "hard for the policy: raise max_num_gen_batches or check the reward")
        return None


@dataclass(frozen=True)
class ScoreResampling(BatchFilter):
    """PF-PPO (algorithm.use_pf_ppo, arXiv 2409.06957): the batch resampled, same size, with replacement, with
    probability by the samples' total scores (hyflow.algos.pf_ppo), seeded by trainer.seed and the step."""

    reweight_method: str
    weight_pow: float
    seed: int
    stage = "advantages"

    def __call__(self, batch: Batch, metrics: dict, step: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = pf_ppo_resample_indices(batch["token_level_scores"].sum(-1), self.reweight_method, self.weight_pow,
                                       generator=generator)
        metrics["pf_ppo/unique_samples"] = float(rows.unique().numel())
        return batch[rows]


def prompts_per_round(cfg: HyflowConfig) -> int:
    """How many prompts each generation round draws: with dynamic sampling data.gen_batch_size (verl's DAPO
    recipe; train_batch_size when unset), else train_batch_size x data.oversample_factor (PRIME's prompt filter
    chooses train_batch_size of them; factor 1: every prompt trains)."""
    d = cfg.data
    if cfg.algorithm.filter_groups.enable:
        return d.gen_batch_size or d.train_batch_size
    return int(d.train_batch_size * d.oversample_factor)


def build_filters(cfg: HyflowConfig) -> list[BatchFilter]:
    """The filters the config turns on, in the order they apply."""
    d, algo, n = cfg.data, cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    filters: list[BatchFilter] = []
    if d.oversample_factor != 1:
        filters.append(PromptFilter(d.train_batch_size, n, cfg.actor_rollout_ref.rollout.response_length,
                                    d.filter_accuracy, d.accuracy_lower_bound, d.accuracy_upper_bound,
                                    d.filter_truncate))
    if algo.filter_groups.enable:
        fg = algo.filter_groups
        filters.append(DynamicSampling(fg.metric, d.train_batch_size, n, fg.max_num_gen_batches))
    if algo.use_pf_ppo:
        filters.append(ScoreResampling(algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow, cfg.trainer.seed))
    return filters


def apply_filters(filters: list[BatchFilter], stage: str, batch: Batch, metrics: dict, step: int) -> Batch:
    """`batch` through the filters of `stage`, in order."""
    for keep in filters:
        if keep.stage == stage:
            batch = keep(batch, metrics, step)
    return batch


def fill_batch(filters: list[BatchFilter], generate_round: Callable[[Batch, int], Batch], next_prompts: Callable[[], Batch],
               prompts: Batch, metrics: dict, step: int) -> Batch:
    """The step's rollout: round r = `generate_round(prompts, r)` through the rollout filters; one round, unless
    a filter refills what it drops (then rounds of `next_prompts()` until that filter's `full` returns the batch)."""
    refill = next((f for f in filters if f.stage == "rollout" and f.refills), None)
    kept: list[Batch] = []
    rounds = 0
    while True:
        rounds += 1
        batch = apply_filters(filters, "rollout", generate_round(prompts, rounds), metrics, step)
        if refill is None:
            return batch
        kept.append(batch)
        if (full := refill.full(kept, rounds, metrics)) is not None:
            return full
        prompts = next_prompts()
