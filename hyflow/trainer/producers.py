"""Column producers: what makes each input an advantage estimator (or the actor's loss) reads.

An estimator declares the inputs it requires by keyword (`@register_advantage_estimator(name, requires=(...))`,
`hyflow.algos.registry`); this module's `PRODUCERS` registry says, for each keyword, which batch column holds it
and which stage of the step makes it. The trainer runs the producers a run needs, in registration order, at their
stage, and hands the estimator every input whose column the batch holds (`estimator_inputs`); it never names an
algorithm. Stages:

- `generated`: each generation round, after the rollout and before scoring; it may rewrite the samples (SPIN's
  reference answers), so scores a reward loop took during the rollout are dropped;
- `scored`: each generation round, after scoring (ReMax's greedy baseline);
- `train`: in `train_on`, before the advantages (old log-probs, the reference's, the teacher's, the critic's
  values, PRIME's implicit process rewards), each timed as `timing_s/<its stage name>`;
- `step`: made by the step itself, nothing to run (the rollout's `uid` groups, the rollout correction's weights,
  the scorer's extra components).

A producer runs when the estimator requires its input or, where it has a `wanted(trainer)`, when that says so (a
KL term reads the reference's log-probs too; a critic, when the run has one, always gives values; a role's input
without its role is then the estimator's error, naming it). A new estimator input = the estimator's `requires`
entry + one `register_producer` call here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyflow.algos import masked_sum, reduce_metrics
from hyflow.batch import Batch
from hyflow.config.arithmetic import prm_mini_batch_size, uses_reference
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.registry import Registry
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.build import pad_token_id
from hyflow.rollout.output import replace_responses

STAGES = ("generated", "scored", "train", "step")


@dataclass
class StepState:
    """What a producer may read or write of the step besides the batch: its metrics, its timings (`train` stage)
    and the round's prompts (`generated` and `scored` stages)."""

    metrics: dict = field(default_factory=dict)
    timing: dict | None = None
    prompts: Batch | None = None


@dataclass(frozen=True)
class Producer:
    """How estimator input `name` is made: batch column `column` (None: a column no estimator reads, e.g. the
    teacher's log-probs for the distillation loss), written by `make(trainer, batch, state) -> batch` at `stage`.
    `wanted(trainer)`: whether this run makes it (default: when the estimator requires it; a role's producer runs
    when the role exists, so a required input without its role is the estimator's error, naming it);
    `read(batch)`: the input's value when it is not one column."""

    name: str
    column: str | None
    stage: str
    make: Callable[[Any, Batch, StepState], Batch] | None = None
    wanted: Callable[[Any], bool] | None = None
    read: Callable[[Batch], Any] | None = None

    def value(self, batch: Batch) -> Any:
        """The input's value in `batch`, or None when the batch does not hold it."""
        if self.read is not None:
            return self.read(batch)
        return batch[self.column] if self.column is not None and self.column in batch else None


PRODUCERS = Registry("column producer", hint="An estimator's `requires` names inputs that hyflow.trainer.producers "
                                              "makes; add one with register_producer there.")


def register_producer(name: str, column: str | None, stage: str, make=None, *, wanted=None, read=None) -> Producer:
    """Register how estimator input `name` is made (see `Producer`); returns the entry."""
    if stage not in STAGES:
        raise ValueError(f"producer {name!r}: stage {stage!r} is not one of {', '.join(STAGES)}")
    return PRODUCERS.register(name, Producer(name, column, stage, make, wanted, read))


def check_estimator_inputs(estimator: Callable, label: str) -> None:
    """Every input `estimator` requires has a producer; otherwise the error names the input and the estimator."""
    for name in getattr(estimator, "requires", ()):
        if name not in PRODUCERS:
            raise PRODUCERS.unknown(name, f" (required by algorithm.adv_estimator={label})")


def plan(trainer, requires: tuple[str, ...]) -> dict[str, list[Producer]]:
    """stage -> the producers this run runs there, in registration order, each `make` once."""
    out: dict[str, list[Producer]] = {stage: [] for stage in STAGES}
    seen: set = set()
    for producer in PRODUCERS.values():
        needed = producer.wanted(trainer) if producer.wanted is not None else producer.name in requires
        if needed and producer.make is not None and producer.make not in seen:
            seen.add(producer.make)
            out[producer.stage].append(producer)
    return out


def estimator_inputs(batch: Batch) -> dict[str, Any]:
    """input name -> value, for every registered input the batch holds (an estimator reads those it wants)."""
    inputs = {}
    for producer in PRODUCERS.values():
        value = producer.value(batch)
        if value is not None:
            inputs[producer.name] = value
    return inputs


# ------------------------------------------------------------------ made by the step itself
def numeric_reward_extras(batch: Batch) -> dict[str, torch.Tensor]:
    """The reward function's extra keys whose values are all numbers (bools count), as float64 tensors [B]."""
    out = {}
    for key in [k for k in batch.keys() if k.startswith("reward_extra/")]:  # noqa: SIM118 (iter = rows)
        values = list(batch[key])
        if values and all(isinstance(v, (bool, int, float, np.number)) for v in values):
            out[key.removeprefix("reward_extra/")] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return out


register_producer("index", "uid", "step")  # the rollout's groups: one uid per prompt, shared by its samples
register_producer("rollout_is_weights", "rollout_is_weights", "step")  # RLTrainer.apply_rollout_correction
register_producer("reward_extras", None, "step", read=numeric_reward_extras)  # the scorer's per-sample components


# ------------------------------------------------------------------ each generation round
def reference_answers(trainer, batch: Batch, state: StepState) -> Batch:
    """The rollout with each group's last sample replaced by the row's reference answer (data.reference_answer_key,
    tokenized and ended with the end-of-sequence token, cut to the response length) and a `reference_answer`
    column marking those rows (the estimators that declare it, SPIN)."""
    key, *path = trainer.config.data.reference_answer_key.split(".")
    tokenizer = trainer.tokenizer
    uids = list(batch["uid"])
    last = [i for i in range(len(uids)) if i + 1 == len(uids) or uids[i + 1] != uids[i]]
    answers = []
    for i in last:
        value = batch[key][i] if key in batch else None
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"data.reference_answer_key={trainer.config.data.reference_answer_key}: row {i} has no "
                             "reference answer there (a string); point it at the data's response")
        answers.append(tokenizer(value, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    out = replace_responses(batch, last, answers, pad_token_id(tokenizer))
    marks = torch.zeros(len(out))
    marks[last] = 1.0
    out["reference_answer"] = marks
    return out


def greedy_baselines(trainer, batch: Batch, state: StepState) -> Batch:
    """`reward_baselines`: the score of one greedy response per prompt, repeated over its samples (ReMax)."""
    r = trainer.config.actor_rollout_ref.rollout
    greedy = trainer.actor.generate_sequences(state.prompts, SamplingParams(n=1, max_new_tokens=r.response_length,
                                                                            do_sample=False))
    baseline = trainer.reward_manager(greedy).token_level_scores.sum(-1)
    batch["reward_baselines"] = baseline.repeat_interleave(r.n)
    return batch


register_producer("reference_answer", "reference_answer", "generated", reference_answers)
register_producer("reward_baselines", "reward_baselines", "scored", greedy_baselines)


# ------------------------------------------------------------------ train_on, before the advantages
def needs_old_log_probs(trainer) -> bool:
    """Whether pi_old is made before the update (verl always does; TRL does not when on-policy): with
    rollout_correction.bypass_mode it is the rollout's log-probs; otherwise the actor's forward, skipped only when
    nothing reads it before the update and the update itself is on-policy (one epoch, one mini-batch): then pi_old
    equals the update's own forward, which the actor uses detached."""
    cfg = trainer.config
    actor = cfg.actor_rollout_ref.actor
    rc = cfg.algorithm.rollout_correction
    return rc.bypass_mode or not (
        actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
        and not cfg.algorithm.use_kl_in_reward and not (rc.rollout_is or rc.rollout_rs)
        and not {"old_log_prob", "sum_pi_squared"} & set(trainer.estimator.requires))


def old_log_probs(trainer, batch: Batch, state: StepState) -> Batch:
    """`old_log_probs` (+ `entropys`, + `sum_pi_squared` when required): the actor's forward, or with
    rollout_correction.bypass_mode the rollout's log-probs."""
    if trainer.config.algorithm.rollout_correction.bypass_mode:
        batch["old_log_probs"] = batch["rollout_log_probs"]  # the rollout's log-probs are pi_old
        return batch
    with trainer.timed("old_log_prob", state.timing):
        batch.union(trainer.actor.compute_log_prob(
            batch, with_sum_pi_squared="sum_pi_squared" in trainer.estimator.requires))
    return batch


def role_forward(role: str, method: str, timer_name: str) -> Callable[[Any, Batch, StepState], Batch]:
    """A producer that joins the columns of `trainer.<role>.<method>(batch)` to the batch, timed as `timer_name`."""
    def make(trainer, batch: Batch, state: StepState) -> Batch:
        with trainer.timed(timer_name, state.timing):
            batch.union(getattr(getattr(trainer, role), method)(batch))
        return batch

    make.__qualname__ = make.__name__ = f"{role}.{method}"
    return make


def implicit_process_rewards(trainer, batch: Batch, state: StepState) -> Batch:
    """PRIME's PRM stage (`hyflow.workers.prm`, `hyflow.algos.prime`): the reference's log-probs once, the PRM's
    update on the step's outcomes (reward_model.model.update=before or after), its q (before: a forward with
    the updated weights; after: the update's own forwards; none: the frozen PRM's forward), then the implicit
    token rewards (`prm_scores`) normalised over the whole batch. Adds verl's reward_model/* metrics."""
    from hyflow.algos.prime import check_outcome_range, prime_process_rewards

    with trainer.timed("prm", state.timing):
        rm, prm = trainer.config.reward_model, trainer.prm
        mask = batch["response_mask"]
        acc = masked_sum(batch["token_level_scores"], mask, dim=-1)
        check_outcome_range(acc)
        batch.union(prm.compute_prm_ref_log_probs(batch))
        update_q = None
        if rm.model.update in ("before", "after"):
            batch["prm_acc"] = acc.unsqueeze(-1).expand_as(mask).contiguous().float()
            batch["prm_row"] = torch.arange(len(batch), dtype=torch.float32).unsqueeze(-1).expand_as(mask).contiguous()
            out = prm.update_prm(with_mini_batch_rows(batch, prm_mini_batch_size(trainer.config)))
            state.metrics.update(reduce_metrics(out.meta["metrics"]))
            update_q = torch.zeros_like(mask, dtype=torch.float32)
            update_q[out["prm_row"].long()] = out["prm_q"]  # the update's own forwards, each before its step
        # after: the update's forwards are the scores; before: a forward of the updated PRM; none: of the frozen one
        q = update_q if rm.model.update == "after" else prm.compute_prm_q(batch)["prm_q"]
        batch["prm_scores"], prm_metrics = prime_process_rewards(
            q, acc, mask, batch["uid"], beta=rm.model.beta_train, granularity=rm.prime_granularity,
            norm=rm.prime_norm, update_q_BT=update_q)
        state.metrics.update(prm_metrics)
    return batch


register_producer("old_log_prob", "old_log_probs", "train", old_log_probs, wanted=needs_old_log_probs)
register_producer("sum_pi_squared", "sum_pi_squared", "train", old_log_probs, wanted=needs_old_log_probs)
register_producer("ref_log_prob", "ref_log_prob", "train", role_forward("actor", "compute_ref_log_prob", "ref"),
                  wanted=lambda trainer: uses_reference(trainer.config))  # a KL loss or KL-in-reward reads it too
register_producer("teacher_log_probs", None, "train",  # on-policy distillation: the teacher scores the samples
                  role_forward("teacher", "compute_teacher_log_probs", "teacher"),
                  wanted=lambda trainer: trainer.teacher is not None)  # the distillation loss reads it
register_producer("values", "values", "train", role_forward("critic", "compute_values", "values"),
                  wanted=lambda trainer: trainer.critic is not None)  # a critic, when the run has one
register_producer("prm_scores", "prm_scores", "train", implicit_process_rewards)
