"""On-policy distillation (distillation.*): teachers, their serving engines and the distillation loss."""

from __future__ import annotations

from hyflow.config.catalog import algorithm_catalog, component_catalog, engine_capabilities, frozen_engines
from hyflow.config.checks import check
from hyflow.config.keys import not_one_of
from hyflow.config.schema import HyflowConfig


@check(680)
def distillation(cfg: HyflowConfig) -> list[str]:
    """On-policy distillation: a teacher with a model, known keys in each teacher entry (verl's), an engine that
    can score, routing keys when there are several teachers, and a loss the actor can compute."""
    from hyflow.config.roles import teacher_models
    from hyflow.config.schema.distillation import (
        INFERENCE_ACTED_ON,
        INFERENCE_PERFORMANCE_ONLY,
        TEACHER_DEFAULTS,
    )

    d = cfg.distillation
    problems = []
    if not d.enabled:
        if d.nnodes > 0:
            problems.append(f"distillation.nnodes={d.nnodes} gives the teacher a pool of its own, but "
                            "distillation.enabled is false; set distillation.enabled=true or drop distillation.nnodes")
        return problems
    loss = d.distillation_loss
    if loss.loss_mode == "forward_kl_topk" and loss.topk < 1:
        problems.append(f"distillation.distillation_loss.topk={loss.topk}: forward_kl_topk needs the teacher's top "
                        "k >= 1 tokens per position (verl's default is 32)")
    catalog = algorithm_catalog()
    if loss.use_policy_gradient and catalog is not None and loss.policy_loss_mode not in catalog.policy_losses:
        problems.append(not_one_of("distillation.distillation_loss.policy_loss_mode", loss.policy_loss_mode,
                                   sorted(catalog.policy_losses)))
    if loss.use_task_rewards is False and loss.use_policy_gradient is False and loss.distillation_loss_coef != 1.0:
        problems.append("distillation.distillation_loss.distillation_loss_coef weighs the distillation loss against "
                        "the task's (use_task_rewards=true); with use_task_rewards=false the distillation loss "
                        "alone is trained (coefficient 1, as in verl): drop distillation_loss_coef or set "
                        "use_task_rewards=true")
    teachers = teacher_models(cfg)
    prefix = "distillation.teacher_models"
    if not any(entry.get("model_path") for entry in teachers.values()):
        problems.append("distillation.enabled=true needs a teacher: set "
                        "distillation.teacher_models.teacher_model.model_path=DIR (a causal LM that shares the "
                        "policy's tokenizer)")
        return problems
    known_inference = set(INFERENCE_ACTED_ON) | set(INFERENCE_PERFORMANCE_ONLY)
    for name, entry in teachers.items():
        unknown = sorted(set(entry) - set(TEACHER_DEFAULTS))
        if unknown:
            problems.append(f"{prefix}.{name} has unknown key(s) {unknown}; a teacher has "
                            f"{', '.join(TEACHER_DEFAULTS)} (verl's)")
        if not entry.get("model_path"):
            problems.append(f"{prefix}.{name}.model_path is not set; give the teacher's model directory or hub id "
                            f"(or remove the {name} entry)")
        inference = dict(entry.get("inference") or {})
        unknown = sorted(set(inference) - known_inference)
        if unknown:
            problems.append(f"{prefix}.{name}.inference has unknown key(s) {unknown}; known: "
                            f"{', '.join(sorted(known_inference))}")
        if inference.get("temperature") not in (None, 1, 1.0):
            problems.append(f"{prefix}.{name}.inference.temperature={inference['temperature']}: the teacher's "
                            "log-probs are taken at temperature 1 (verl warns and uses 1.0 too: a temperature does "
                            "not apply to prompt log-probs); remove it")
        if inference.get("load_format") == "dummy":
            problems.append(f"{prefix}.{name}.inference.load_format=dummy would give the teacher random weights (the "
                            "rollout's dummy format waits for the trainer's weights, which a teacher never gets); "
                            "drop it (a teacher always loads its model's weights)")
        engine = inference.get("name") or cfg.actor_rollout_ref.rollout.name
        caps = engine_capabilities(engine)
        if component_catalog() is not None and (caps is None or not caps.serves_frozen):
            frozen = frozen_engines()  # today hf and vllm
            problems.append(f"{prefix}.{name}.inference.name={engine!r}: a teacher is served by the "
                            f"{' or the '.join(frozen)} engine; set inference.name={' or '.join(frozen)}")
    if len(teachers) > 1:
        keys = [entry.get("key") for entry in teachers.values()]
        if None in keys or len(set(keys)) != len(keys):
            problems.append(f"{len(teachers)} teachers in {prefix}: each needs its own `key` (the value of "
                            f"distillation.teacher_key={d.teacher_key!r} its samples carry), e.g. "
                            f"+{prefix}.NAME.key=openai/gsm8k; got keys {keys}")
    return problems
