"""The RL trainer: the dataflow of one step, run by one driver over worker groups.

Every step does, in this order (docs/architecture.md's dataflow; each stage a named call in `step`):

1. rollout: sample `rollout.n` responses per prompt and score them (rule functions, a custom function, or a
   reward model), round after round while a batch filter (`hyflow.trainer.filters`, composed from the config:
   dynamic sampling, the oversampled prompts' filter) refills what it drops; each round runs the column producers
   of the rollout (`hyflow.trainer.producers`: rows rewritten before scoring, baselines after it);
2. the column producers of the step, each only when something downstream reads its column: the actor's
   log-probs of its own samples (`old_log_probs`, entropy), the reference policy's, a distillation teacher's, the
   critic's values, and whatever else the estimator declares it requires (`estimator.requires`);
3. token-level rewards: the scores, minus a KL penalty when `algorithm.use_kl_in_reward`;
4. rollout correction (truncated importance weights / rejection) when configured;
5. advantages and returns from the estimator named by `algorithm.adv_estimator`, then the batch filters that
   act on advantages (resampling by score);
6. critic update, then actor update (after `trainer.critic_warmup` steps), then the rollout engine takes the
   new weights.

The trainer never branches on an algorithm's name: estimators declare the inputs they need, producers make them,
filters come from the config, losses are looked up by name inside the actor. The executor is configuration:
`trainer.executor=local` runs every worker in this process (one device; `breakpoint()` works anywhere), `ray`
runs one worker process per device (`trainer.nnodes` x `trainer.n_gpus_per_node`) with torch.distributed and
FSDP2; the code below is the same for both. Validation scores the whole validation set at each test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hyflow.algos import reduce_metrics
from hyflow.algos.kl import make_kl_controller
from hyflow.algos.registry import get_advantage_estimator
from hyflow.batch import Batch
from hyflow.config import (
    HyflowConfig,
    config_to_dict,
    config_to_yaml,
    describe_batch_arithmetic,
    load_config,
    validate_config,
)
from hyflow.config.arithmetic import own_pool_roles, role_devices, uses_prm, uses_reference
from hyflow.config.checks.model_fit import check_model_fit
from hyflow.config.loader import derived_default_notes
from hyflow.config.roles import role_specs, teacher_performance_notes, uses_judge
from hyflow.config.support import engine_line, performance_only_warning
from hyflow.controller import LocalWorkerGroup, describe_placement
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.data.rl_dataset import PromptLoader
from hyflow.models.loading import is_score_model, is_vision_model, load_tokenizer
from hyflow.models.packing import prompt_group_ids
from hyflow.rewards.custom import combine_reward_functions, load_custom_reward_function
from hyflow.rewards.registry import check_scorers_exist
from hyflow.rollout.base import SamplingParams
from hyflow.threads import configure_threads
from hyflow.trainer import async_training, estimate, generation, scoring, trainer_checkpoint, validation
from hyflow.trainer.balance import balanced_group_order, balanced_order
from hyflow.trainer.checkpoint import CheckpointManager
from hyflow.trainer.filters import apply_filters, build_filters, fill_batch, prompts_per_round
from hyflow.trainer.metrics import compute_data_metrics, compute_throughput_metrics, memory_metrics, timer
from hyflow.trainer.producers import StepState, check_estimator_inputs, plan
from hyflow.trainer.profiling import StepProfiling, profile_plan
from hyflow.trainer.replay import check_replay_shape, load_rollout, save_rollout
from hyflow.trainer.report import latest_checkpoint, sample_rows, speed_defaults_line, where_interrupted
from hyflow.trainer.rl_datasets import prompt_processor, rl_dataset
from hyflow.trainer.roles import Roles, build_roles, check_local_ray_cluster, has_rollout_pool
from hyflow.trainer.run_dir import claim_run_directory
from hyflow.trainer.tracking import (
    ProgressBar,
    Tracker,
    dump_generations,
    format_already_complete,
    format_run_summary,
    truncate_metrics,
)
from hyflow.trainer.validation import validation_order  # noqa: F401 (imported from here by callers)
from hyflow.workers.teacher import check_teacher_tokenizers

ROLLOUT_SEED_DEFAULT = 42  # actor_rollout_ref.rollout.seed's default (verl's)


class RLTrainer:
    """PPO-family training from a config (object, or a list of verl-style overrides).

    `reward_fn`: a Python callable with verl's signature (`compute_score(data_source, solution_str,
    ground_truth, extra_info=None, **kw)`) used instead of the built-in scorers; `train_dataset` /
    `val_dataset`: RLDataset objects, file paths, in-memory rows in verl's schema (a list of dicts or a Hugging Face
    `datasets.Dataset`) instead of `data.train_files` / `data.val_files`. `reward_fn`: one function with verl's
    signature, or a list of them (their scores are summed, weighted by `reward_weights`, TRL's convention; each
    function's own score is also reported as `reward/<name>/mean`).
    """

    def __init__(self, config: HyflowConfig | Sequence[str] | None = None, *,
                 reward_fn: Callable | Sequence[Callable] | None = None,
                 train_dataset=None, val_dataset=None, tokenizer=None,
                 reward_weights: Sequence[float] | None = None) -> None:
        self.config = config if isinstance(config, HyflowConfig) else load_config(list(config or []))
        validate_config(self.config)
        cfg = self.config
        if (accepted := performance_only_warning(cfg)) is not None:
            print(accepted)  # once, at start: keys that only change speed or memory (hyflow.config.support)
        if (engine := engine_line(cfg)) is not None:
            print(engine)  # a run written for verl's Megatron / VeOmni / torchtitan engine: what runs it here
        self.profile_plan = profile_plan(cfg)  # verl's profiler keys (hyflow.trainer.profiling)
        if (profiler_line := self.profile_plan.start_line()) is not None:
            print(profiler_line)
        self.profiling: StepProfiling | None = None
        self.n_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node  # the actor's (and colocated roles')
        self.async_mode = cfg.async_training.mode != "sync"
        self.total_devices = (self.n_devices + sum(role_devices(cfg, role) for role in own_pool_roles(cfg))
                              + (cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node if has_rollout_pool(cfg) else 0))
        self.executor = cfg.trainer.executor if cfg.trainer.executor != "auto" else (
            "local" if self.total_devices == 1 else "ray")
        if self.executor == "local" and self.n_devices > 1:
            raise ValueError(f"trainer.executor=local runs one device, but trainer.nnodes x trainer.n_gpus_per_node = "
                             f"{self.n_devices}; use trainer.executor=ray (or auto) for more")
        if not cfg.actor_rollout_ref.model.path:
            raise ValueError("set actor_rollout_ref.model.path to a model directory or hub id "
                             "(make a tiny one with: hyflow init-model --preset tiny --out DIR)")
        self.tokenizer = tokenizer or load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path
                                                     or cfg.actor_rollout_ref.model.path,
                                                     trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code
                                                     or cfg.data.trust_remote_code)
        # a vision-language model's image processor: image rows are expanded into the image's tokens
        self.processor = prompt_processor(cfg.actor_rollout_ref.model.path, self.tokenizer,
                                          trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                                          data_cfg=cfg.data)
        # a generative reward model (a causal LM behind reward_model.rollout.name) judges the samples; a classifier
        # there is scored by hyflow's forward, as verl's discriminative reward model served by its engine
        rm = cfg.reward_model
        self.judged = uses_judge(cfg) and not is_score_model(rm.model.path,
                                                             trust_remote_code=rm.model.trust_remote_code)
        # the config fits the loaded models: teachers' tokenizers, a critic that sees images, the judge's manager
        check_model_fit(cfg, self.tokenizer, self.processor, judged=self.judged, is_vision_model=is_vision_model,
                        check_teacher_tokenizers=check_teacher_tokenizers)
        if cfg.distillation.enabled:
            for note in teacher_performance_notes(cfg):
                print(note)
        inputs = {"data_cfg": cfg.data, "tokenizer": self.tokenizer, "processor": self.processor,
                  "tool_config_path": cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path}
        self.train_dataset = rl_dataset(train_dataset, cfg.data.train_files, cfg.data.train_max_samples, "train",
                                        **inputs)
        self.val_dataset = rl_dataset(val_dataset, cfg.data.val_files, cfg.data.val_max_samples, "val", **inputs)
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        if reward_weights is not None and not isinstance(reward_fn, (list, tuple)):
            raise ValueError("reward_weights weighs a list of reward functions: pass reward_fn=[f1, f2, ...] with it")
        self.reward_fn = (combine_reward_functions(reward_fn, reward_weights) if isinstance(reward_fn, (list, tuple))
                          else reward_fn)
        if reward_fn is None and cfg.custom_reward_function.path:
            self.reward_fn = load_custom_reward_function(cfg.custom_reward_function.path,
                                                         cfg.custom_reward_function.name,
                                                         dict(cfg.custom_reward_function.reward_kwargs or {}))
        if uses_judge(cfg) and not self.judged:
            print(f"hyflow: reward_model.model.path={rm.model.path} is a sequence classifier: hyflow scores it with "
                  "its own forward (reward_model.micro_batch_size_per_gpu, ...); reward_model.rollout.* (how verl's "
                  "engine serves it) only change speed and memory here")
        rule_scored = (not cfg.reward_model.enable or uses_prm(cfg)  # PRIME's outcome is the rule score
                       or (self.judged and cfg.reward_model.judge.rule_weight != 0))
        if self.reward_fn is None and rule_scored and cfg.reward_model.reward_manager != "http":
            check_scorers_exist(self._data_sources())  # the built-in scorers must cover the data
        # verl's reward_model.use_reward_loop: score each trajectory as it finishes (hyflow.rewards.reward_loop)
        self.use_reward_loop = cfg.reward_model.use_reward_loop
        if self.use_reward_loop and self.async_mode:
            from hyflow.rewards.reward_loop import reward_loop_unsupported

            print(f"reward_model.use_reward_loop: {reward_loop_unsupported(None, async_mode=True)}; scoring each "
                  "batch after its rollout instead")
            self.use_reward_loop = False
        for note in derived_default_notes(cfg):  # e.g. the off-policy correction an asynchronous mode runs with
            print(note)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.global_step = 0
        self.history: list[dict] = []
        self.progress: ProgressBar | None = None  # set while fit() runs: the stages show on it
        self.started_ray = False
        self.groups: list = []
        self.roles: Roles | None = None

    # ------------------------------------------------------------------ set-up
    def _data_sources(self) -> dict[str, str]:
        """data_source -> the row where it first appears, over the training and validation rows that a reward
        function scores (not rows whose agent loop scores its own trajectory: env_agent)."""
        from hyflow.rollout.agent_loop import AGENT_LOOPS

        key, seen = self.config.data.reward_fn_key, {}
        default = self.config.actor_rollout_ref.rollout.agent.default_agent_loop
        self_scoring: dict[str, bool] = {}
        for dataset in (self.train_dataset, self.val_dataset):
            for row in getattr(dataset, "rows", None) or []:
                name = row.get("agent_name") or default
                if name not in self_scoring:
                    loop = AGENT_LOOPS.get(name) if name in AGENT_LOOPS else None
                    self_scoring[name] = bool(getattr(loop, "scores_trajectories", False))
                if not self_scoring[name]:
                    seen.setdefault(row.get(key), row.get("_where", "the dataset"))
        return seen

    def setup(self) -> None:
        """Workers, data loader, reward managers, tracker; resume from a checkpoint when one applies."""
        cfg = self.config
        check_estimator_inputs(self.estimator, cfg.algorithm.adv_estimator)  # a producer for each input it requires
        # each generation round's prompts: train_batch_size, or what the rollout filters draw (hyflow.trainer.filters)
        self.loader = PromptLoader(self.train_dataset, prompts_per_round(cfg), shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed or cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(self.loader)
        # One source of batch arithmetic: the role specs carry it; it is what is printed and what the roles run.
        self.specs = role_specs(cfg, n_devices=self.n_devices, total_steps=self.total_steps, judge=self.judged)
        self.batches = self.specs.batches
        print(describe_batch_arithmetic(cfg, n_devices=self.n_devices, batches=self.batches))
        print(speed_defaults_line(cfg))
        # torch threads of this process: all usable cores in-process, a share of them beside Ray workers
        configure_threads(1 if self.executor == "local" else max(1, self.total_devices // max(1, cfg.trainer.nnodes)))
        # The run directory first, before any model loads: locked for this process, and what to resume decided
        # (a previous run that cannot be resumed is an error, never a silent start over it).
        keep = [k for k in (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) if k is not None]
        self.checkpoints = CheckpointManager(self.run_dir, max_to_keep=min(keep) if keep else None)
        self.run_claim = claim_run_directory(self.run_dir, cfg.trainer.resume_mode, cfg.trainer.resume_from_path,
                                             self.checkpoints)
        self.started_ray = False
        if self.executor == "ray":
            from hyflow.controller.resources import ensure_ray, starts_local_cluster

            ray_init = {k: v for k, v in dict(cfg.ray_kwargs.ray_init or {}).items() if v is not None}
            if starts_local_cluster(cfg.ray_kwargs.address):
                check_local_ray_cluster(cfg, self.specs, ray_init)  # what it cannot hold, said before it starts
            self.started_ray = ensure_ray(cfg.ray_kwargs.address, ray_init=ray_init)
        # The worker groups and pools (hyflow.trainer.roles): the trainer talks to one view per role.
        self.roles = build_roles(cfg, self.specs, executor=self.executor, tokenizer=self.tokenizer,
                                 judge=self.judged, total_steps=self.total_steps)
        self.workers, self.groups = self.roles.workers, self.roles.groups
        self.profiling = StepProfiling(self.profile_plan, self.groups) if self.profile_plan.active else None
        if (placement := describe_placement(self.groups)) is not None:
            print(placement)  # which node each rank landed on, when the ranks span several nodes
        self.actor, self.critic, self.reward_model = self.roles.actor, self.roles.critic, self.roles.reward_model
        self.teacher, self.prm = self.roles.teacher, self.roles.prm
        self.scheduler = async_training.async_scheduler(self) if self.async_mode else None
        self.use_reference = uses_reference(cfg)
        self.producers = plan(self, self.estimator.requires)  # stage -> what this run makes (hyflow.trainer.producers)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.reward_manager = scoring.reward_manager(self, num_examine=0)
        self.val_reward_manager = scoring.reward_manager(self, num_examine=1)
        resume = self.run_claim.resume_path
        if resume is not None:
            self.load_checkpoint(resume)
        if self.scheduler is not None:
            self.scheduler.start()  # the rollout gets the (resumed) weights
        truncate_metrics(self.run_dir, self.global_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        self.tracker = Tracker(self.run_dir, cfg.trainer.logger, project_name=cfg.trainer.project_name,
                               experiment_name=cfg.trainer.experiment_name, config=config_to_dict(cfg))


    def shutdown(self) -> None:
        """Stop the worker processes (and the local Ray cluster this trainer started); release the run directory."""
        if getattr(self, "run_claim", None) is not None:
            self.run_claim.release()
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.shutdown()
            self.scheduler = None
        if getattr(self, "roles", None) is not None:
            self.roles.shutdown()  # the worker groups, then their Ray pools
        self.groups, self.workers = [], None
        if self.started_ray:
            from hyflow.controller.resources import shutdown_ray

            shutdown_ray()
            self.started_ray = False

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict]:
        """Train for `total_training_steps` (or `total_epochs`); returns the logged metrics of every step.

        At the end it prints a summary (elapsed time, steps, final and best validation metric, run directory,
        last checkpoint and its export command); a resumed run with no step left says so and trains nothing."""
        cfg = self.config.trainer
        self.tracker = None
        started = time.perf_counter()
        finished = False
        start_step = 0
        last_checkpoint = None
        try:
            self.setup()
            start_step = self.global_step
            if 0 < self.total_steps <= self.global_step:
                print(format_already_complete(self.run_dir, self.global_step, self.total_steps,
                                              latest_checkpoint(self.checkpoints)), flush=True)
                return self.history
            with ProgressBar(self.total_steps, initial=self.global_step) as bar:
                self.progress = bar
                self._report_progress(bar.advance)  # rollout trajectories and update micro-batches on the bar
                if self.val_dataset is not None and cfg.val_before_train and self.global_step == 0:
                    with self.timed("testing", {}):  # a long validation shows its progress too
                        self.log(self.validate(), step=0)
                    if cfg.val_only:
                        return self.history
                while self.global_step < self.total_steps:
                    self.global_step += 1
                    start = time.perf_counter()
                    if self.profiling is not None:
                        self.profiling.before_step(self.global_step)
                    metrics = self.async_step() if self.scheduler is not None else self.step(self.loader.next_batch())
                    last = self.global_step == self.total_steps
                    if self.val_dataset is not None and (last or (cfg.test_freq > 0 and
                                                                   self.global_step % cfg.test_freq == 0)):
                        with self.timed("testing", timing := {}):
                            metrics.update(self.validate())
                        metrics["timing_s/testing"] = timing["testing"]
                    if cfg.save_freq > 0 and (last or self.global_step % cfg.save_freq == 0):
                        with self.timed("save_checkpoint", timing := {}):
                            last_checkpoint = self.save_checkpoint()
                        metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
                    if self.profiling is not None:  # the step's trace covers its validation and checkpoint
                        self.profiling.after_step(self.global_step)
                    metrics["timing_s/step_total"] = time.perf_counter() - start
                    self.log(metrics, step=self.global_step)
                    bar.update(metrics)
            finished = True
        except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: the CLI prints one line saying where the run stands
            raise type(interrupt)(where_interrupted(self.global_step, getattr(self, "total_steps", 0),
                                                    last_checkpoint, getattr(self, "checkpoints", None))) from None
        finally:
            if self.profiling is not None:  # a run that ends inside a profiled step still writes its trace
                with contextlib.suppress(Exception):
                    self.profiling.stop()
            if self.progress is not None:
                self._report_progress(None)
            self.progress = None
            if self.tracker is not None:
                self.tracker.close()
            self.shutdown()
        if finished:  # last, after the services' own closing output
            print(format_run_summary(self.run_dir, elapsed_s=time.perf_counter() - started, step=self.global_step,
                                     total_steps=self.total_steps, start_step=start_step,
                                     checkpoint=last_checkpoint or latest_checkpoint(self.checkpoints),
                                     history=self.history),
                  flush=True)
        return self.history

    def _report_progress(self, callback) -> None:
        """Hand `callback` (ProgressBar.advance, or None) to rank 0 of each in-process worker group, whose rollout
        and updates then report progress inside the step; Ray workers run elsewhere and report none."""
        for group in self.groups:
            if isinstance(group, LocalWorkerGroup) and group.workers:
                for role in getattr(group.workers[0], "roles", {}).values():
                    if hasattr(role, "set_progress"):
                        role.set_progress(callback)

    def timed(self, name: str, timing: dict[str, float]):
        """`timer(name, timing)`, with the progress bar showing the stage while it runs."""
        if self.progress is not None:
            self.progress.stage(name)
        return timer(name, timing)

    def step(self, prompts: Batch) -> dict[str, float]:
        """One RL step on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timing):  # the stages below show on the bar
            with self.timed("gen", timing):
                batch = self.rollout_or_replay(prompts, metrics)
            if self.progress is not None:
                self.progress.generated(len(batch), batch["response_mask"], timing["gen"])
            batch = self.train_on(batch, metrics, timing)
        return self.step_metrics(batch, metrics, timing)

    async_step = async_training.async_step  # take a finished batch, launch the next work, train, collect

    def train_on(self, batch: Batch, metrics: dict, timing: dict) -> Batch:
        """Stages 2-6 of a step on a scored rollout batch: produce the columns, advantages, filter, updates, sync."""
        batch.meta["global_step"] = self.global_step
        if self.config.trainer.balance_batch and self.actor.world_size > 1:
            batch = batch.reorder(self.balanced_order(batch))
        state = StepState(metrics, timing)
        for producer in self.producers["train"]:  # log-probs, reference, teacher, values, ... as this run needs
            batch = producer.make(self, batch, state)
        with self.timed("adv", timing):
            self.apply_token_level_rewards(batch, metrics)
            self.apply_rollout_correction(batch, metrics)
            self.compute_advantages(batch)
            batch = self.filter_policy(batch, metrics)
        if self.config.trainer.rollout_data_dir:
            with self.timed("dump_rollout_generations", timing):
                rows = sample_rows(batch, self.reward_manager.decode_responses(batch)[0], self.tokenizer)
                dump_generations(rows, self.config.trainer.rollout_data_dir, self.global_step)
        if self.critic is not None:
            with self.timed("update_critic", timing):
                rows = self.config.critic.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
                out = self.critic.update_critic(with_mini_batch_rows(batch, rows))  # mini-batch-major over ranks
                metrics.update(reduce_metrics(out.meta["metrics"]))
        if self.global_step > self.config.trainer.critic_warmup:
            with self.timed("update_actor", timing):
                rows = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
                out = self.actor.update_actor(with_mini_batch_rows(batch, rows))
                metrics.update(reduce_metrics(out.meta["metrics"]))
            with self.timed("update_weights", timing):
                self.actor.sync_rollout_weights()  # timed per rank too: the slowest bounds the step
            freq = self.config.trainer.ref_update_freq
            if freq > 0 and self.global_step % freq == 0:  # the reference plays the last iteration's policy
                with self.timed("update_ref", timing):
                    self.actor.update_reference()
        return batch

    def step_metrics(self, batch: Batch, metrics: dict, timing: dict) -> dict[str, float]:
        """The step's metrics: the stages' own, plus data, timing, throughput and memory metrics."""
        cfg = self.config
        metrics.update(compute_data_metrics(batch, max_response_length=cfg.actor_rollout_ref.rollout.response_length,
                                            max_prompt_length=cfg.data.max_prompt_length))
        metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
        metrics.update(compute_throughput_metrics(batch, timing["step"], n_devices=self.total_devices))
        metrics.update(memory_metrics())
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = self.loader.epoch
        return metrics

    # ------------------------------------------------------------------ stages
    def sampling_params(self, *, validate: bool = False, seed: int | None = None) -> SamplingParams:
        r = self.config.actor_rollout_ref.rollout
        source = r.val_kwargs if validate else r
        if seed is not None:  # rollout.seed moves every call's seed (its default, 42, leaves them as they were)
            seed += (r.seed - ROLLOUT_SEED_DEFAULT) * 1_000_000_007
        return SamplingParams(n=source.n, max_new_tokens=r.response_length, temperature=source.temperature,
                              top_p=source.top_p, top_k=source.top_k, do_sample=source.do_sample,
                              calculate_log_probs=r.calculate_log_probs, seed=seed)

    def balanced_order(self, batch: Batch) -> torch.Tensor:
        """`trainer.balance_batch`'s row order: similar token counts per rank; with prompt sharing
        (`actor.use_prefix_grouper`) a prompt's samples stay on one rank where the group sizes allow it."""
        lengths, world = batch["attention_mask"].sum(-1), self.actor.world_size
        if self.config.actor_rollout_ref.actor.use_prefix_grouper:
            width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
            order = balanced_group_order(lengths, prompt_group_ids(batch["input_ids"], batch["attention_mask"], width),
                                         batch["attention_mask"][:, :width].sum(-1), world)
            if order is not None:
                return order
        return balanced_order(lengths, world)

    score = scoring.score  # token_level_scores (and the scorer's extra columns) into the batch; reward metrics

    def rollout_or_replay(self, prompts: Batch, metrics: dict) -> Batch:
        """The step's scored rollout: generated and scored (and written for replay with trainer.rollout_data_dir),
        or read back from trainer.replay_rollouts (hyflow.trainer.replay)."""
        trainer = self.config.trainer
        if trainer.replay_rollouts:
            batch, saved = load_rollout(trainer.replay_rollouts, self.global_step)
            check_replay_shape(batch, samples=len(prompts) * self.config.actor_rollout_ref.rollout.n,
                               directory=trainer.replay_rollouts, step=self.global_step)
            metrics.update(saved)
            return batch
        batch = self.rollout_and_score(prompts, metrics)
        if trainer.rollout_data_dir:
            save_rollout(batch, metrics, trainer.rollout_data_dir, self.global_step)
        return batch

    def rollout_and_score(self, prompts: Batch, metrics: dict) -> Batch:
        """Generate and score; with a refilling rollout filter (dynamic sampling), keep generating rounds until
        enough prompts pass it (hyflow.trainer.filters.fill_batch)."""
        return fill_batch(build_filters(self.config), lambda round_prompts, rounds: self.generate_round(
            round_prompts, rounds, metrics), self.loader.next_batch, prompts, metrics, self.global_step)

    generate_round = generation.generate_round  # one round: rollout, the round's producers, scores

    apply_token_level_rewards = estimate.apply_token_level_rewards  # scores (- KL when configured) -> rewards
    apply_rollout_correction = estimate.apply_rollout_correction  # truncated IS weights, rejection masks
    compute_advantages = estimate.compute_advantages  # the estimator over the producers' columns

    def filter_policy(self, batch: Batch, metrics: dict) -> Batch:
        """The batch filters that act after the advantages (hyflow.trainer.filters: resampling by score, seeded by
        trainer.seed and the step); the batch unchanged when the config turns none on."""
        return apply_filters(build_filters(self.config), "advantages", batch, metrics, self.global_step)

    # ------------------------------------------------------------------ validation, checkpoints and logging
    validate = validation.validate  # generate for the whole validation set, score, val-core / val-aux metrics
    role_checkpoints = trainer_checkpoint.role_checkpoints  # the roles' part of checkpoints
    save_checkpoint = trainer_checkpoint.save  # global_step_N/: the roles' state and the trainer's own
    load_checkpoint = trainer_checkpoint.load  # resume from global_step_N/

    def log(self, metrics: dict, step: int) -> None:
        self.tracker.log(metrics, step=step)
        self.history.append({"step": step, **metrics})


def run_rl(overrides: Sequence[str], config_file: str | None = None) -> list[dict]:
    """`hyflow train <overrides>`: build the config, train, return the per-step metrics."""
    return RLTrainer(load_config(list(overrides), config_file=config_file)).fit()
