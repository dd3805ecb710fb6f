"""The distillation teacher worker: frozen teachers, each on an engine of its own, score the policy's samples.

`compute_teacher_log_probs(batch)` returns, per sample of this rank's share, what the distillation loss reads
(`hyflow.algos.distillation`): `teacher_log_probs` [N, R], the teacher's log-prob of each sampled response token,
and for forward_kl_topk (`spec.topk` > 0) `teacher_topk_log_probs` / `teacher_topk_ids` [N, R, K], the teacher's
own K most likely tokens at each response position. Zeros at padding. The scoring is the engine protocol's
optional `prompt_log_probs` (`hyflow.rollout.base`): the hf engine runs the teacher's forward, vllm asks for
prompt log-probs, so a teacher is just another engine.

Several teachers (verl's multi-teacher distillation): each sample goes to the teacher whose `key` equals its
`spec.teacher_key` field (`data_source` by default); one teacher scores every sample. A sample whose value
matches no teacher is an error naming the value and the keys there are.

Placement (`hyflow.trainer.roles`): in the actor's worker processes (`distillation.nnodes=0`: one whole copy per
device) or in a pool of its own (`distillation.nnodes` x `distillation.n_gpus_per_node`); either way the batch is
split over the workers (data parallel) and every worker holds every teacher whole. Sleep/wake is not used: a
teacher's memory stays allocated for the run (`free_cache_engine` is accepted as performance-only).
"""

from __future__ import annotations

import dataclasses

import torch

from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.rollout.base import EngineSpec, engine_capabilities, make_engine
from hyflow.rollout.build import eos_token_ids, pad_token_id
from hyflow.specs import ModelSpec, TeacherModelSpec, TeacherSpec
from hyflow.workers.train_engine import resolve_device

TEACHER_COLUMNS = ("teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids")


def serve_model(engine: str, model: ModelSpec, *, device: torch.device, dtype: str, max_num_seqs: int, rollout,
                overrides: dict | None = None):
    """A frozen model (a teacher, a judge) served by engine `engine` on `device`, loading its own weights.

    hf: the model in eval mode (fp32 on CPU, `dtype` on an accelerator), generating `max_num_seqs` rows per call;
    vllm: its own runtime, configured by the rollout section `rollout` with `overrides` (the model's own inference
    settings: dtype, max_model_len, engine_kwargs, ...) and `load_format=auto` (the rollout's "dummy" waits for the
    trainer's weights, which a frozen model never gets)."""
    tokenizer = load_tokenizer(model.path, trust_remote_code=model.trust_remote_code, config_key=model.config_key)
    pad = pad_token_id(tokenizer)
    if not engine_capabilities(engine).loads_model:  # it generates with a torch module (hf): loaded here
        module = load_causal_lm(model.path, dtype="float32" if device.type == "cpu" else dtype,
                                trust_remote_code=model.trust_remote_code, device=device, config_key=model.config_key)
        module.requires_grad_(False)
        module.eval()
        rows = type("Rows", (), {"max_num_seqs": max_num_seqs})()
        return make_engine(engine, EngineSpec(model_path=model.path, device=device, rollout=rows,
                                              eos_token_ids=eos_token_ids(tokenizer, module), pad_token_id=pad,
                                              module=module, share_module=True))
    settings = {key: value for key, value in (overrides or {}).items() if hasattr(rollout, key)}
    rollout = dataclasses.replace(rollout, **{"max_num_seqs": max_num_seqs, **settings, "load_format": "auto"})
    return make_engine(engine, EngineSpec(model_path=model.path, device=device, rollout=rollout,
                                          eos_token_ids=eos_token_ids(tokenizer), pad_token_id=pad,
                                          trust_remote_code=model.trust_remote_code))


class TeacherWorker(Worker):
    """Frozen teachers on one device, scoring this rank's share of the samples."""

    def __init__(self, spec: TeacherSpec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.model_device = resolve_device(spec.device, self.local_rank)
        self.engines: dict[str, object] = {}

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load every teacher into its engine (hf: the model in eval mode, fp32 on CPU; vllm: its own runtime)."""
        for teacher in self.spec.teachers:
            self.engines[teacher.name] = self._engine(teacher)

    def _engine(self, teacher: TeacherModelSpec):
        rollout = self.spec.rollout
        overrides = {key: teacher.inference[key] for key in ("dtype", "max_num_seqs", "gpu_memory_utilization",
                                                             "enforce_eager", "max_model_len", "engine_kwargs")
                     if teacher.inference.get(key) is not None}
        # a sequence of prompt_length + response_length tokens plus the one token vLLM generates must fit
        overrides.setdefault("max_model_len", rollout.prompt_length + rollout.response_length + 1)
        if self.spec.topk > 20:  # vLLM's default max_logprobs is 20 (verl raises it the same way)
            kwargs = dict(overrides.get("engine_kwargs", rollout.engine_kwargs) or {})
            kwargs["vllm"] = {"max_logprobs": self.spec.topk, **dict(kwargs.get("vllm") or {})}
            overrides["engine_kwargs"] = kwargs
        return serve_model(teacher.engine, teacher.model, device=self.model_device, dtype=teacher.dtype,
                           max_num_seqs=teacher.max_num_seqs, rollout=rollout, overrides=overrides)

    def route(self, batch: Batch) -> dict[str, torch.Tensor]:
        """teacher name -> the row indices of `batch` it scores (`spec.teacher_key`; one teacher: every row)."""
        teachers = self.spec.teachers
        if len(teachers) == 1:
            return {teachers[0].name: torch.arange(len(batch))}
        field = self.spec.teacher_key
        if field not in batch:
            raise ValueError(f"distillation.teacher_key={field!r}: the samples have no {field!r} field to pick a "
                             f"teacher by; set distillation.teacher_key to a field of the data (e.g. data_source)")
        by_key = {teacher.key: teacher.name for teacher in teachers}
        rows: dict[str, list[int]] = {}
        for index, value in enumerate(batch[field]):
            if value not in by_key:
                raise ValueError(f"a sample's {field} is {value!r}, which no teacher's key names "
                                 f"(distillation.teacher_models.*.key: {sorted(map(str, by_key))}); add a teacher "
                                 "for it or route it to one")
            rows.setdefault(by_key[value], []).append(index)
        return {name: torch.tensor(indices) for name, indices in rows.items()}

    @register(Dispatch.DP_SPLIT)
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """`teacher_log_probs` [N, R] (and the top-k columns [N, R, K] when spec.topk > 0) of this rank's share."""
        N, R, K = len(batch), batch["responses"].shape[1], self.spec.topk
        out = {"teacher_log_probs": torch.zeros(N, R)}
        if K:
            out["teacher_topk_log_probs"] = torch.zeros(N, R, K)
            out["teacher_topk_ids"] = torch.zeros(N, R, K, dtype=torch.long)
        sequences = Batch({key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")})
        if sequences["position_ids"].dim() == 3:
            raise ValueError("on-policy distillation of a vision-language policy is not built yet: its teacher would "
                             "need the images; use a text-only policy (or turn distillation.enabled off)")
        for name, rows in self.route(batch).items():
            scores = self.engines[name].prompt_log_probs(sequences[rows], R, topk=K)
            response_mask = batch["attention_mask"][rows, -R:].bool()
            out["teacher_log_probs"][rows] = torch.where(response_mask, scores["log_probs"].float(), 0.0)
            if K:
                keep = response_mask.unsqueeze(-1)
                out["teacher_topk_log_probs"][rows] = torch.where(keep, scores["topk_log_probs"].float(), 0.0)
                out["teacher_topk_ids"][rows] = torch.where(keep, scores["topk_ids"].long(), 0)
        return Batch(out)


def check_teacher_tokenizers(spec: TeacherSpec, policy_tokenizer) -> None:
    """Every teacher must read the student's token ids as the same text: the same tokenizer (class, vocabulary and
    special tokens, `hyflow.workers.reward_model.same_tokenizer`); checked at start, before any model loads."""
    from hyflow.workers.reward_model import same_tokenizer

    for teacher in spec.teachers:
        tokenizer = load_tokenizer(teacher.model.path, trust_remote_code=teacher.model.trust_remote_code,
                                   config_key=teacher.model.config_key)
        if not same_tokenizer(policy_tokenizer, tokenizer):
            raise ValueError(
                f"{teacher.model.config_key}={teacher.model.path}: the teacher's tokenizer "
                f"({type(tokenizer).__name__} {tokenizer.name_or_path!r}, {len(tokenizer)} tokens) is not the "
                f"policy's ({type(policy_tokenizer).__name__} {policy_tokenizer.name_or_path!r}, "
                f"{len(policy_tokenizer)} tokens); on-policy distillation scores the student's token ids with the "
                "teacher, so both must share one tokenizer (vocabulary and special tokens): use a teacher of the "
                "policy's model family")
