"""The RL trainer: the dataflow of one step, run by one driver over worker groups.

Every step does, in this order (docs/architecture.md's dataflow; each stage a named call in `step`):

1. rollout: sample `rollout.n` responses per prompt, score them (rule functions, a custom function, or a
   reward model); with `algorithm.filter_groups` keep generating until the batch holds `train_batch_size`
   prompts whose samples disagree (DAPO's dynamic sampling); with `data.oversample_factor` generate more and
   keep `train_batch_size` prompts, those passing PRIME's accuracy / truncation filter first; estimators that need
   a greedy baseline (ReMax) get one more, greedy rollout;
2. the actor's log-probs of its own samples (`old_log_probs`, entropy), the reference policy's, a distillation
   teacher's, the critic's values, PRIME's implicit PRM (trained on the outcomes, then its token rewards) — each
   only when something downstream needs it;
3. token-level rewards: the scores, minus a KL penalty when `algorithm.use_kl_in_reward`;
4. rollout correction (truncated importance weights / rejection) when configured;
5. advantages and returns from the estimator named by `algorithm.adv_estimator`;
6. critic update, then actor update (after `trainer.critic_warmup` steps), then the rollout engine takes the
   new weights.

The trainer never branches on an algorithm's name: estimators declare the inputs they need
(`estimator.requires`), losses are looked up by name inside the actor. The executor is configuration:
`trainer.executor=local` runs every worker in this process (one device; `breakpoint()` works anywhere), `ray`
runs one worker process per device (`trainer.nnodes` x `trainer.n_gpus_per_node`) with torch.distributed and
FSDP2; the code below is the same for both. Validation scores the whole validation set at each test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from hyflow.algos import (
    apply_kl_penalty,
    compute_rollout_correction,
    compute_validation_metrics,
    masked_sum,
    pf_ppo_resample_indices,
    reduce_metrics,
)
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
from hyflow.config.arithmetic import (
    own_pool_roles,
    prm_mini_batch_size,
    role_devices,
    uses_critic,
    uses_prm,
    uses_reference,
)
from hyflow.config.loader import derived_default_notes
from hyflow.config.roles import role_specs, uses_judge
from hyflow.config.support import performance_only_warning
from hyflow.controller import LocalWorkerGroup, describe_placement
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.data.rl_dataset import PromptLoader
from hyflow.models.loading import is_score_model, is_vision_model, load_tokenizer
from hyflow.models.packing import prompt_group_ids
from hyflow.rewards.custom import combine_reward_functions, load_custom_reward_function
from hyflow.rewards.managers import make_reward_manager, require_finite_scores, score_with_agent_rewards
from hyflow.rewards.registry import check_scorers_exist
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.build import pad_token_id
from hyflow.rollout.output import replace_responses
from hyflow.threads import configure_threads
from hyflow.trainer.balance import balanced_group_order, balanced_order
from hyflow.trainer.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from hyflow.trainer.metrics import compute_data_metrics, compute_throughput_metrics, memory_metrics, timer
from hyflow.trainer.replay import check_replay_shape, load_rollout, save_rollout
from hyflow.trainer.report import latest_checkpoint, sample_rows, speed_defaults_line, where_interrupted
from hyflow.trainer.rl_datasets import prompt_processor, rl_dataset
from hyflow.trainer.role_checkpoints import RoleCheckpoints, RoleState
from hyflow.trainer.roles import Roles, build_roles, has_rollout_pool
from hyflow.trainer.run_dir import claim_run_directory
from hyflow.trainer.tracking import (
    ProgressBar,
    Tracker,
    dump_generations,
    format_already_complete,
    format_run_summary,
    truncate_metrics,
)

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
        if cfg.distillation.enabled:  # the teachers must read the student's token ids as the same text
            from hyflow.config.roles import teacher_performance_notes, teacher_spec
            from hyflow.workers.teacher import check_teacher_tokenizers

            check_teacher_tokenizers(teacher_spec(cfg), self.tokenizer)
            for note in teacher_performance_notes(cfg):
                print(note)
        # a vision-language model's image processor: image rows are expanded into the image's tokens
        self.processor = prompt_processor(cfg.actor_rollout_ref.model.path, self.tokenizer,
                                          trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                                          data_cfg=cfg.data)
        if self.processor is not None and uses_critic(cfg):  # the critic sees the images too
            critic_path = cfg.critic.model.path or cfg.actor_rollout_ref.model.path
            if not is_vision_model(critic_path, trust_remote_code=cfg.critic.model.trust_remote_code):
                raise ValueError(f"critic.model.path={critic_path} is a text-only model, but the policy is a "
                                 "vision-language model whose prompts hold images the critic could not see; make the "
                                 "critic a vision-language model of the same family (e.g. critic.model.path = the "
                                 "policy's path)")
        if (self.processor is not None and cfg.actor_rollout_ref.rollout.name == "vllm"
                and cfg.data.mm_processor_kwargs):
            raise ValueError("data.mm_processor_kwargs with actor_rollout_ref.rollout.name=vllm: vLLM processes the "
                             "images with the model's own image processor settings, so the rollout and the trainer "
                             "would see different image sizes; put min_pixels / max_pixels into the model's "
                             "preprocessor_config.json instead (or use rollout.name=hf)")
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
        # a generative reward model (a causal LM behind reward_model.rollout.name) judges the samples; a classifier
        # there is scored by hyflow's forward, as verl's discriminative reward model served by its engine
        rm = cfg.reward_model
        self.judged = uses_judge(cfg) and not is_score_model(rm.model.path,
                                                             trust_remote_code=rm.model.trust_remote_code)
        if self.judged and rm.reward_manager not in ("naive", "dapo"):
            raise ValueError(f"reward_model.reward_manager={rm.reward_manager} with a generative reward model "
                             f"({rm.model.path} is a causal LM): the judge's manager scores like naive (with dapo's "
                             "overlong penalty when enabled); use naive or dapo, and mix in a rule scorer with "
                             "reward_model.judge.rule_weight")
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

    def _reward_manager(self, num_examine: int):
        rm = self.config.reward_model
        kwargs = dict(num_workers=rm.num_workers, timeout_s=rm.timeout_s, reward_kwargs=dict(rm.reward_kwargs or {}),
                      num_examine=num_examine, max_response_length=self.config.actor_rollout_ref.rollout.response_length,
                      overlong_buffer=config_to_dict(self.config)["reward_model"]["overlong_buffer"],
                      max_error_fraction=rm.max_error_fraction)
        if self.judged:  # the judge's score (mixed with the rule scorer's by weight), hyflow.rewards.judge
            from hyflow.rewards.judge import JudgeRewardManager

            return JudgeRewardManager(self.tokenizer, compute_score=self.reward_fn, judge=self._judge(),
                                      judge_weight=rm.judge.weight, rule_weight=rm.judge.rule_weight, **kwargs)
        return make_reward_manager(rm.reward_manager, self.tokenizer, compute_score=self.reward_fn, **kwargs,
                                   experiment_name=self.config.trainer.experiment_name)

    def _judge(self):
        """The generative reward model: prompts from `reward_model.judge`, answers from the judge's worker group
        (`generate`, the engine's call), sampled with `reward_model.rollout`'s settings."""
        from hyflow.rewards.judge import GenerativeJudge, JudgeSampling, engine_generate

        rm = self.config.reward_model
        r, j = rm.rollout, rm.judge
        tokenizer = load_tokenizer(rm.model.path, trust_remote_code=rm.model.trust_remote_code,
                                   config_key="reward_model.model.path")
        pad = pad_token_id(tokenizer)
        sampling = JudgeSampling(max_new_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p,
                                 top_k=r.top_k, do_sample=r.do_sample, seed=r.seed)
        return GenerativeJudge(tokenizer, engine_generate(self.reward_model, pad, SamplingParams), template=j.template,
                               template_path=j.template_path, sampling=sampling, score_pattern=j.score_pattern,
                               score_range=tuple(j.score_range) if j.score_range else None, normalize=j.normalize,
                               system_prompt=j.system_prompt, max_prompt_length=r.prompt_length)

    def setup(self) -> None:
        """Workers, data loader, reward managers, tracker; resume from a checkpoint when one applies."""
        cfg = self.config
        # With dynamic sampling every generation round draws data.gen_batch_size prompts (verl's DAPO recipe).
        # With data.oversample_factor (PRIME's prompt filter) each step draws train_batch_size x the factor.
        prompts_per_round = ((cfg.data.gen_batch_size or cfg.data.train_batch_size) if cfg.algorithm.filter_groups.enable
                             else int(cfg.data.train_batch_size * cfg.data.oversample_factor))
        self.loader = PromptLoader(self.train_dataset, prompts_per_round, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed or cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(self.loader)
        # One source of batch arithmetic: the role specs carry it; it is what is printed and what the roles run.
        self.specs = role_specs(cfg, n_devices=self.n_devices, total_steps=self.total_steps)
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
            from hyflow.controller.resources import ensure_ray

            ray_init = {k: v for k, v in dict(cfg.ray_kwargs.ray_init or {}).items() if v is not None}
            self.started_ray = ensure_ray(cfg.ray_kwargs.address, ray_init=ray_init)
        # The worker groups and pools (hyflow.trainer.roles): the trainer talks to one view per role.
        self.roles = build_roles(cfg, self.specs, executor=self.executor, tokenizer=self.tokenizer,
                                 judge=self.judged, total_steps=self.total_steps)
        self.workers, self.groups = self.roles.workers, self.roles.groups
        if (placement := describe_placement(self.groups)) is not None:
            print(placement)  # which node each rank landed on, when the ranks span several nodes
        self.actor, self.critic, self.reward_model = self.roles.actor, self.roles.critic, self.roles.reward_model
        self.teacher, self.prm = self.roles.teacher, self.roles.prm
        self.scheduler = self._async_scheduler() if self.async_mode else None
        self.use_reference = uses_reference(cfg)
        self.needs_old_log_probs = self._needs_old_log_probs()
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.reward_manager = self._reward_manager(num_examine=0)
        self.val_reward_manager = self._reward_manager(num_examine=1)
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

    def _async_scheduler(self):
        """The rollout side of an asynchronous run (its own worker group on `rollout.*` devices, or the actor's
        workers) and the scheduler over it."""
        from hyflow.trainer.async_scheduler import AsyncScheduler

        cfg = self.config
        separate = self.roles.rollout is not None  # the rollout pool of its own (build_roles), or the actor's
        rollout = self.roles.rollout if separate else self.actor
        r = cfg.actor_rollout_ref.rollout
        return AsyncScheduler(rollout, self.loader, cfg.async_training, separate=separate,
                              batch_prompts=cfg.data.train_batch_size, n=r.n, response_length=r.response_length,
                              prompt_length=r.prompt_length, critic_warmup=cfg.trainer.critic_warmup,
                              seed=cfg.trainer.seed, sampling_params=self.sampling_params,
                              export_weights=self.actor.export_weights)

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

    def _needs_old_log_probs(self) -> bool:
        """Whether pi_old must be recomputed before the update (verl always does; TRL does not when on-policy).

        It is skipped only when nothing reads it before the update and the update itself is on-policy (one
        epoch, one mini-batch): then pi_old equals the update's own forward, which the actor uses detached.
        """
        cfg = self.config
        actor = cfg.actor_rollout_ref.actor
        rc = cfg.algorithm.rollout_correction
        return not (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
                    and not cfg.algorithm.use_kl_in_reward and not (rc.rollout_is or rc.rollout_rs)
                    and not {"old_log_prob", "sum_pi_squared"} & set(self.estimator.requires))

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
                    with self._timed("testing", {}):  # a long validation shows its progress too
                        self.log(self.validate(), step=0)
                    if cfg.val_only:
                        return self.history
                while self.global_step < self.total_steps:
                    self.global_step += 1
                    start = time.perf_counter()
                    metrics = self.async_step() if self.scheduler is not None else self.step(self.loader.next_batch())
                    last = self.global_step == self.total_steps
                    if self.val_dataset is not None and (last or (cfg.test_freq > 0 and
                                                                   self.global_step % cfg.test_freq == 0)):
                        with self._timed("testing", timing := {}):
                            metrics.update(self.validate())
                        metrics["timing_s/testing"] = timing["testing"]
                    if cfg.save_freq > 0 and (last or self.global_step % cfg.save_freq == 0):
                        with self._timed("save_checkpoint", timing := {}):
                            last_checkpoint = self.save_checkpoint()
                        metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
                    metrics["timing_s/step_total"] = time.perf_counter() - start
                    self.log(metrics, step=self.global_step)
                    bar.update(metrics)
            finished = True
        except KeyboardInterrupt:  # Ctrl-C: the CLI prints one line saying where the run stands
            raise KeyboardInterrupt(where_interrupted(self.global_step, getattr(self, "total_steps", 0),
                                                      last_checkpoint, getattr(self, "checkpoints", None))) from None
        finally:
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

    def _timed(self, name: str, timing: dict[str, float]):
        """`timer(name, timing)`, with the progress bar showing the stage while it runs."""
        if self.progress is not None:
            self.progress.stage(name)
        return timer(name, timing)

    def step(self, prompts: Batch) -> dict[str, float]:
        """One RL step on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timing):  # the stages below show on the bar
            with self._timed("gen", timing):
                batch = self.rollout_or_replay(prompts, metrics)
            if self.progress is not None:
                self.progress.generated(len(batch), batch["response_mask"], timing["gen"])
            batch = self.train_on(batch, metrics, timing)
        return self.step_metrics(batch, metrics, timing)

    def async_step(self) -> dict[str, float]:
        """One asynchronous RL step (async_training.mode; hyflow.trainer.async_scheduler): take a batch the rollout
        has finished, start the rollout's next work, train on the batch meanwhile, collect, push weights."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        scheduler = self.scheduler
        with timer("step", timing):
            with self._timed("gen", timing):  # the trainer waits for a batch (the rollout runs alone)
                batch = scheduler.next_batch(metrics)
                metrics.update(scheduler.batch_metrics(batch))
                metrics.update(self.score(batch, self.reward_manager))
            pending = scheduler.launch()  # the rollout works on the next prompts ...
            start = time.perf_counter()
            batch = self.train_on(batch, metrics, timing)  # ... while this trains
            train_s = time.perf_counter() - start
            with self._timed("async_collect", timing):
                scheduler.land(pending, metrics)
            scheduler.updated(self.global_step > self.config.trainer.critic_warmup, metrics)
        # With a rollout pool of its own the rollout's advance ran while the trainer trained; in one process it ran
        # first (same samples, no overlap).
        busy = metrics.get("async/rollout_busy_s", 0.0)
        overlapped = min(busy, train_s) if pending is not None and scheduler.separate else 0.0
        metrics["async/overlap_share"] = overlapped / timing["step"]
        metrics["async/rollout_wait_s"] = max(0.0, timing["step"] - busy)
        metrics["trainer/idle_ratio"] = metrics["async/trainer_wait_s"] / timing["step"]
        metrics["rollouter/idle_ratio"] = metrics["async/rollout_wait_s"] / timing["step"]
        return self.step_metrics(batch, metrics, timing)

    def train_on(self, batch: Batch, metrics: dict, timing: dict) -> Batch:
        """Stages 2-6 of a step on a scored rollout batch: log-probs, values, advantages, updates, weight sync."""
        batch.meta["global_step"] = self.global_step
        if self.config.trainer.balance_batch and self.actor.world_size > 1:
            batch = batch.reorder(self.balanced_order(batch))
        if self.config.algorithm.rollout_correction.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]  # the rollout's log-probs are pi_old
        elif self.needs_old_log_probs:
            with self._timed("old_log_prob", timing):
                batch.union(self.actor.compute_log_prob(
                    batch, with_sum_pi_squared="sum_pi_squared" in self.estimator.requires))
        if self.use_reference:
            with self._timed("ref", timing):
                batch.union(self.actor.compute_ref_log_prob(batch))
        if self.teacher is not None:  # on-policy distillation: the teacher scores the samples
            with self._timed("teacher", timing):
                batch.union(self.teacher.compute_teacher_log_probs(batch))
        if self.critic is not None:
            with self._timed("values", timing):
                batch.union(self.critic.compute_values(batch))
        if "prm_scores" in self.estimator.requires:  # PRIME: the implicit PRM trains on the samples and scores them
            with self._timed("prm", timing):
                metrics.update(self.implicit_process_rewards(batch))
        with self._timed("adv", timing):
            self.apply_token_level_rewards(batch, metrics)
            self.apply_rollout_correction(batch, metrics)
            self.compute_advantages(batch)
            batch = self.filter_policy(batch, metrics)
        if self.config.trainer.rollout_data_dir:
            with self._timed("dump_rollout_generations", timing):
                rows = sample_rows(batch, self.reward_manager.decode_responses(batch)[0], self.tokenizer)
                dump_generations(rows, self.config.trainer.rollout_data_dir, self.global_step)
        if self.critic is not None:
            with self._timed("update_critic", timing):
                rows = self.config.critic.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
                out = self.critic.update_critic(with_mini_batch_rows(batch, rows))  # mini-batch-major over ranks
                metrics.update(reduce_metrics(out.meta["metrics"]))
        if self.global_step > self.config.trainer.critic_warmup:
            with self._timed("update_actor", timing):
                rows = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
                out = self.actor.update_actor(with_mini_batch_rows(batch, rows))
                metrics.update(reduce_metrics(out.meta["metrics"]))
            with self._timed("update_weights", timing):
                self.actor.sync_rollout_weights()  # timed per rank too: the slowest bounds the step
            freq = self.config.trainer.ref_update_freq
            if freq > 0 and self.global_step % freq == 0:  # the reference plays the last iteration's policy
                with self._timed("update_ref", timing):
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

    def score(self, batch: Batch, manager, loop_scores=None) -> dict[str, float]:
        """Write `token_level_scores` (and the scorer's extra columns) into `batch`; return reward metrics.

        verl's priority: a custom reward function, else the reward model (`reward_model.enable`), else the
        built-in scorer of each sample's data_source. `loop_scores`: what the reward loop scored during the rollout
        (`hyflow.rewards.reward_loop`), which gives the same result as scoring now; `timing_s/reward` is the time
        spent scoring either way.
        """
        if self.reward_model is not None and not self.judged:  # a discriminative reward model
            rm_scores = self.reward_model.compute_rm_score(batch)["rm_scores"]
            require_finite_scores(rm_scores, source="the reward model (reward_model.model.path)", column="rm_scores")
            batch["rm_scores"] = rm_scores
            if self.reward_fn is None:
                batch["token_level_scores"] = rm_scores
                return {"reward/rm_score/mean": float(rm_scores.sum(-1).mean())}
        if loop_scores is not None:
            result = loop_scores.result(batch)
        else:
            start = time.perf_counter()
            result = score_with_agent_rewards(manager, batch)  # rows an agent loop scored keep that score
            result.metrics["timing_s/reward"] = time.perf_counter() - start
        batch["token_level_scores"] = result.token_level_scores
        for key, values in result.extra.items():
            batch[f"reward_extra/{key}"] = values
        return result.metrics

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
        """Generate and score; with filter_groups, keep generating until enough prompts have varied scores."""
        cfg = self.config
        n, wanted = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
        fg = cfg.algorithm.filter_groups
        kept: list[Batch] = []
        rounds = 0
        while True:
            rounds += 1
            prompts["uid"] = [f"step{self.global_step}-round{rounds}-{i}" for i in range(len(prompts))]
            seed = (cfg.trainer.seed * 1_000_003 + self.global_step) * 101 + rounds
            if self.use_reward_loop:  # each trajectory scored as it finishes, while the rest generate
                from hyflow.rewards.reward_loop import generate_and_score, reward_loop_unsupported

                why = reward_loop_unsupported(self.reward_manager,
                                              rule_scores=self.reward_model is None or self.reward_fn is not None)
                if why is not None:
                    print(f"reward_model.use_reward_loop: {why}; scoring after the rollout instead")
                    self.use_reward_loop = False
            loop_scores = None
            if self.use_reward_loop:
                batch, loop_scores = generate_and_score(self.reward_manager, self.actor, prompts,
                                                        self.sampling_params(seed=seed), executor=self.executor)
            else:
                batch = self.actor.generate_sequences(prompts, self.sampling_params(seed=seed))
            metrics.update(reduce_metrics(batch.meta.pop("metrics", {})))  # the agent loop's and the engine's
            if "reference_answer" in self.estimator.requires:  # SPIN: the data's answer in the last sample's place
                batch, loop_scores = self.with_reference_answers(batch), None
            metrics.update(self.score(batch, self.reward_manager, loop_scores))
            if "reward_baselines" in self.estimator.requires:
                greedy_params = SamplingParams(n=1, max_new_tokens=cfg.actor_rollout_ref.rollout.response_length,
                                               do_sample=False)
                greedy = self.actor.generate_sequences(prompts, greedy_params)
                baseline = self.reward_manager(greedy).token_level_scores.sum(-1)
                batch["reward_baselines"] = baseline.repeat_interleave(n)
            if cfg.data.oversample_factor != 1:
                return self.prioritised_prompts(batch, metrics)
            if not fg.enable:
                return batch
            batch = self.keep_varied_groups(batch, fg.metric)
            kept.append(batch)
            have = sum(len(b) for b in kept) // n
            metrics["train/num_gen_batches"] = rounds
            if have >= wanted:
                return Batch.concat(kept)[: wanted * n]
            if 0 < fg.max_num_gen_batches <= rounds:
                raise RuntimeError(f"dynamic sampling kept {have} of {wanted} prompts after {rounds} generation "
                                   "rounds (algorithm.filter_groups.max_num_gen_batches); the task is too easy or too "
                                   "hard for the policy: raise max_num_gen_batches or check the reward")
            prompts = self.loader.next_batch()

    def with_reference_answers(self, batch: Batch) -> Batch:
        """The rollout with each group's last sample replaced by the row's reference answer (data.reference_answer_key,
        tokenized and ended with the end-of-sequence token, cut to the response length) and a `reference_answer`
        column marking those rows (the estimators that declare it, SPIN)."""
        key, *path = self.config.data.reference_answer_key.split(".")
        uids = list(batch["uid"])
        last = [i for i in range(len(uids)) if i + 1 == len(uids) or uids[i + 1] != uids[i]]
        answers = []
        for i in last:
            value = batch[key][i] if key in batch else None
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            if not isinstance(value, str):
                raise ValueError(f"data.reference_answer_key={self.config.data.reference_answer_key}: row {i} has no "
                                 "reference answer there (a string); point it at the data's response")
            answers.append(self.tokenizer(value, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        pad = pad_token_id(self.tokenizer)
        out = replace_responses(batch, last, answers, pad)
        marks = torch.zeros(len(out))
        marks[last] = 1.0
        out["reference_answer"] = marks
        return out

    def prioritised_prompts(self, batch: Batch, metrics: dict) -> Batch:
        """verl-recipe prime's `filter_and_downsample`: of the oversampled prompts keep data.train_batch_size, those
        passing the filters first (data.filter_accuracy: mean score in [accuracy_lower_bound, accuracy_upper_bound];
        data.filter_truncate: no sample reached max_response_length - 1 tokens), each part in generation order.
        Metrics: `acc` (verl's: the mean score of every generated sample) and `train/filter_pass_share`."""
        d, n = self.config.data, self.config.actor_rollout_ref.rollout.n
        scores = masked_sum(batch["token_level_scores"], batch["response_mask"], dim=-1)
        uids = list(batch["uid"])
        order = list(dict.fromkeys(uids))
        rows = {uid: [i for i, u in enumerate(uids) if u == uid] for uid in order}
        lengths = batch["response_mask"].sum(-1)
        passes = {}
        for uid in order:
            ok = True
            if d.filter_accuracy:
                mean = float(scores[rows[uid]].mean())
                ok = d.accuracy_lower_bound <= mean <= d.accuracy_upper_bound
            if d.filter_truncate:
                ok = ok and int(lengths[rows[uid]].max()) < self.config.actor_rollout_ref.rollout.response_length - 1
            passes[uid] = ok
        chosen = ([uid for uid in order if passes[uid]] + [uid for uid in order if not passes[uid]])
        chosen = chosen[: self.config.data.train_batch_size]
        metrics["acc"] = float(scores.mean())
        metrics["train/filter_pass_share"] = sum(passes.values()) / max(len(order), 1)
        keep = torch.tensor([i for uid in chosen for i in rows[uid]], dtype=torch.long)
        if len(keep) != self.config.data.train_batch_size * n:
            raise RuntimeError(f"data.oversample_factor: {len(order)} prompts of {n} samples were generated, fewer "
                               f"than data.train_batch_size={self.config.data.train_batch_size}")
        return batch[keep]

    @staticmethod
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

    def implicit_process_rewards(self, batch: Batch) -> dict[str, float]:
        """PRIME's PRM stage (`hyflow.workers.prm`, `hyflow.algos.prime`): the reference's log-probs once, the PRM's
        update on the step's outcomes (reward_model.model.update=before or after), its q (before: a forward with
        the updated weights; after: the update's own forwards; none: the frozen PRM's forward), then the implicit
        token rewards (`prm_scores`) normalised over the whole batch. Returns verl's reward_model/* metrics."""
        from hyflow.algos.prime import check_outcome_range, prime_process_rewards

        rm = self.config.reward_model
        mask = batch["response_mask"]
        acc = masked_sum(batch["token_level_scores"], mask, dim=-1)
        check_outcome_range(acc)
        batch.union(self.prm.compute_prm_ref_log_probs(batch))
        metrics: dict[str, float] = {}
        update_q = None
        if rm.model.update in ("before", "after"):
            batch["prm_acc"] = acc.unsqueeze(-1).expand_as(mask).contiguous().float()
            batch["prm_row"] = torch.arange(len(batch), dtype=torch.float32).unsqueeze(-1).expand_as(mask).contiguous()
            out = self.prm.update_prm(with_mini_batch_rows(batch, prm_mini_batch_size(self.config)))
            metrics.update(reduce_metrics(out.meta["metrics"]))
            update_q = torch.zeros_like(mask, dtype=torch.float32)
            update_q[out["prm_row"].long()] = out["prm_q"]  # the update's own forwards, each before its step
        # after: the update's forwards are the scores; before: a forward of the updated PRM; none: of the frozen one
        q = update_q if rm.model.update == "after" else self.prm.compute_prm_q(batch)["prm_q"]
        batch["prm_scores"], prm_metrics = prime_process_rewards(
            q, acc, mask, batch["uid"], beta=rm.model.beta_train, granularity=rm.prime_granularity,
            norm=rm.prime_norm, update_q_BT=update_q)
        return {**metrics, **prm_metrics}

    def apply_token_level_rewards(self, batch: Batch, metrics: dict) -> None:
        """token_level_rewards = scores, minus beta * KL(old || ref) per token when use_kl_in_reward. A non-finite
        score stops the run here, naming its rows, whatever produced it (every score passes this point)."""
        require_finite_scores(batch["token_level_scores"], source="this step's scoring (reward function, agent loops, "
                              "reward model, or trainer.replay_rollouts)")
        algo = self.config.algorithm
        if not algo.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return
        rewards, kl_metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                               batch["ref_log_prob"], batch["response_mask"],
                                               kl_coef=self.kl_ctrl.value, kl_penalty=algo.kl_penalty)
        batch["token_level_rewards"] = rewards
        metrics.update({k: float(v) for k, v in kl_metrics.items()})
        self.kl_ctrl.update(float(kl_metrics["actor/reward_kl_penalty"]), n_steps=len(batch))

    def apply_rollout_correction(self, batch: Batch, metrics: dict) -> None:
        """Truncated IS weights and rejection masks from old vs rollout log-probs (algorithm.rollout_correction)."""
        rc = self.config.algorithm.rollout_correction
        if not (rc.rollout_is or rc.rollout_rs):
            return
        weights, mask, corr = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
        batch["response_mask"] = mask
        if weights is not None:
            batch["rollout_is_weights"] = weights
        metrics.update(corr)

    def compute_advantages(self, batch: Batch) -> None:
        """advantages, returns = the configured estimator over the inputs it declares it needs, with the
        `algorithm` knobs it reads (`hyflow.algos.registry.estimator_knobs`); the per-row columns an estimator
        returns beside them (online DPO's pairs) join the batch."""
        from hyflow.algos.registry import estimator_knobs

        algo = self.config.algorithm
        available = {"values": "values", "index": "uid", "reward_baselines": "reward_baselines",
                     "old_log_prob": "old_log_probs", "sum_pi_squared": "sum_pi_squared",
                     "rollout_is_weights": "rollout_is_weights", "ref_log_prob": "ref_log_prob",
                     "reference_answer": "reference_answer", "prm_scores": "prm_scores"}
        inputs = {name: batch[column] for name, column in available.items() if column in batch}
        inputs["reward_extras"] = numeric_reward_extras(batch)  # the reward function's per-sample components
        missing = [name for name in self.estimator.requires if name not in inputs]
        if missing:
            raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator!r} needs {missing}, which this run does "
                             "not produce (a critic gives `values`: critic.enable=True)")
        advantages, returns, *columns = self.estimator(token_level_rewards=batch["token_level_rewards"],
                                                       response_mask=batch["response_mask"],
                                                       **estimator_knobs(vars(algo), self.estimator), **inputs)
        batch["advantages"], batch["returns"] = advantages, returns
        for name, column in (columns[0] if columns else {}).items():
            batch[name] = column

    def filter_policy(self, batch: Batch, metrics: dict) -> Batch:
        """PF-PPO (algorithm.use_pf_ppo, arXiv 2409.06957): the batch resampled, same size, with replacement, with
        probability by the samples' total scores (hyflow.algos.pf_ppo), seeded by trainer.seed and the step;
        the batch unchanged otherwise."""
        algo = self.config.algorithm
        if not algo.use_pf_ppo:
            return batch
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + self.global_step)
        rows = pf_ppo_resample_indices(batch["token_level_scores"].sum(-1), algo.pf_ppo.reweight_method,
                                       algo.pf_ppo.weight_pow, generator=generator)
        metrics["pf_ppo/unique_samples"] = float(rows.unique().numel())
        return batch[rows]

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate for the whole validation set (val_kwargs), score, and compute val-core / val-aux metrics."""
        cfg = self.config
        ds = self.val_dataset
        size = cfg.data.val_batch_size or len(ds)
        params = self.sampling_params(validate=True, seed=cfg.trainer.seed)
        sources, uids, preds, rows, agent_metrics = [], [], [], [], []
        scores: dict[str, list] = {"reward": []}
        order = validation_order(len(ds), cfg.data.validation_shuffle, cfg.data.seed or cfg.trainer.seed)
        for start in range(0, len(ds), size):
            indices = order[start : start + size]
            prompts = ds.collate([ds[i] for i in indices])
            prompts["uid"] = [f"val-{i}" for i in indices]
            batch = self.actor.generate_sequences(prompts, params)
            agent_metrics.append(batch.meta.pop("metrics", {}))
            self.score(batch, self.val_reward_manager)
            seq_scores = batch["token_level_scores"].sum(-1).tolist()
            scores["reward"] += seq_scores
            extra_keys = [k for k in batch.keys() if k.startswith("reward_extra/")]  # noqa: SIM118 (iter = rows)
            for key in extra_keys:
                scores.setdefault(key.removeprefix("reward_extra/"), []).extend(batch[key])
            sources += list(batch["data_source"])
            uids += list(batch["uid"])
            preds += list(batch["reward_extra/pred"]) if "reward_extra/pred" in batch else [None] * len(batch)
            rows += sample_rows(batch, self.val_reward_manager.decode_responses(batch)[0], self.tokenizer)
        scores.pop("pred", None)
        self.tracker.log_generations(rows, step=self.global_step, split="val",
                                     max_table_rows=cfg.trainer.log_val_generations)
        if cfg.trainer.validation_data_dir:
            dump_generations(rows, cfg.trainer.validation_data_dir, self.global_step)
        has_preds = any(p is not None for p in preds)
        metrics = compute_validation_metrics(sources, uids, scores, preds if has_preds else None, seed=cfg.trainer.seed)
        # multi-turn: the agent loop's tool, turn, OpenAI-agent and environment metrics of the validation rollouts
        metrics.update({f"val-aux/{key}": value for key, value in reduce_metrics(agent_metrics).items()
                        if key.startswith(("tool/", "num_turns/", "openai/", "env/"))})
        return metrics

    # ------------------------------------------------------------------ checkpoints and logging
    def log(self, metrics: dict, step: int) -> None:
        self.tracker.log(metrics, step=step)
        self.history.append({"step": step, **metrics})

    def role_checkpoints(self) -> RoleCheckpoints:
        """The roles' part of checkpoints (hyflow.trainer.role_checkpoints): the actor, and the critic when there
        is one, each with its checkpoint section's save and load contents."""
        if getattr(self, "_role_checkpoints", None) is None:
            cfg = self.config
            roles = {"actor": (self.actor, cfg.actor_rollout_ref.actor.checkpoint)}
            if self.critic is not None:
                roles["critic"] = (self.critic, cfg.critic.checkpoint)
            if self.prm is not None:  # PRIME's implicit PRM trains too: saved with the actor's contents
                roles["prm"] = (self.prm, cfg.actor_rollout_ref.actor.checkpoint)
            self._role_checkpoints = RoleCheckpoints(
                self.checkpoints, {name: RoleState(group, tuple(ckpt.save_contents), tuple(ckpt.load_contents))
                                   for name, (group, ckpt) in roles.items()},
                checkpoint_format=cfg.trainer.checkpoint_format, model_cfg=cfg.actor_rollout_ref.model,
                tokenizer=self.processor or self.tokenizer)  # a VLM's image processor travels with its tokenizer
        return self._role_checkpoints

    def save_checkpoint(self) -> Path:
        """`global_step_N/`: the roles' state and the trainer's own (step, data-loader position, KL controller,
        asynchronous scheduler, RNG), the configs and tokenizer; atomic."""
        state = {"global_step": self.global_step, "loader": self.loader.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict()}
        if self.scheduler is not None:
            state["async"] = self.scheduler.state_dict()
        if "extra" in self.config.actor_rollout_ref.actor.checkpoint.save_contents:
            state["rng"] = capture_rng_state()
        return self.role_checkpoints().save(self.global_step, state, config_yaml=config_to_yaml(self.config))

    def load_checkpoint(self, path: Path) -> None:
        """Resume from `global_step_N/` (full or sharded, written by any number of workers)."""
        state = self.role_checkpoints().load(path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.scheduler is None and "async" in state:
            raise ValueError(f"checkpoint {path} was saved by an asynchronous run (async_training.mode) with prompts "
                             "admitted but not trained yet, which a synchronous run would skip; resume it with the "
                             "async_training settings it was saved with")
        if self.scheduler is not None:
            if "async" not in state:
                raise ValueError(f"checkpoint {path} was saved by a synchronous run; resume it with "
                                 "async_training.mode=sync, or start the asynchronous run in a new directory")
            self.scheduler.load_state_dict(state["async"], step=self.global_step)
        if "rng" in state and "extra" in self.config.actor_rollout_ref.actor.checkpoint.load_contents:
            restore_rng_state(state["rng"])
        freq = self.config.trainer.ref_update_freq
        if freq > 0 and self.global_step >= freq:  # the reference took the actor's weights at the last multiple
            if self.global_step % freq:
                raise ValueError(f"checkpoint {path} is of step {self.global_step}, not a multiple of "
                                 f"trainer.ref_update_freq={freq}: the reference policy of that step (the actor of "
                                 f"step {self.global_step - self.global_step % freq}) is not in it; resume from a "
                                 "checkpoint of a multiple")
            self.actor.update_reference()
        print(f"resumed from {path} at step {self.global_step}")


def validation_order(size: int, shuffle: bool, seed: int) -> list[int]:
    """The order in which validation prompts are generated (data.validation_shuffle): file order, or a
    permutation drawn from a generator seeded with `seed` (data.seed or trainer.seed), the same at every
    validation of a run. Metrics cover the whole set either way; the order changes how prompts are batched."""
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def run_rl(overrides: Sequence[str], config_file: str | None = None) -> list[dict]:
    """`hyflow train <overrides>`: build the config, train, return the per-step metrics."""
    return RLTrainer(load_config(list(overrides), config_file=config_file)).fit()


def numeric_reward_extras(batch: Batch) -> dict[str, torch.Tensor]:
    """The reward function's extra keys whose values are all numbers (bools count), as float64 tensors [B]."""
    out = {}
    for key in [k for k in batch.keys() if k.startswith("reward_extra/")]:  # noqa: SIM118 (iter = rows)
        values = list(batch[key])
        if values and all(isinstance(v, (bool, int, float, np.number)) for v in values):
            out[key.removeprefix("reward_extra/")] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return out
