"""No silent keys: every leaf of the RL and SFT schemas is read by hyflow's code, rejected as "not supported by
this hyflow version yet", or declared performance-only (accepted, named once at start) in
`hyflow.config.support`'s one table.

"Read by code" is checked by searching hyflow's source (without the schema files, the support tables and
validate.py and config/checks/, whose checks are not uses; comments and prose strings blanked) for the leaf read as an attribute
`.<leaf>`, as a mapping item `["<leaf>"]` / `.get("<leaf>"`, through `getattr(obj, "<leaf>"`, or as its dotted
key string. A leaf name that several leaves share (`seed`, `path`, `param_offload` of four FSDP sections) counts
as read only in a file that also names its section (the parent segment, e.g. `overlong_buffer` or `critic`);
that cannot tell the four FSDP sections apart, so their per-role truth is kept by hand in the table.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import tokenize
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

import hyflow
from hyflow.config import ConfigError, load_config, support, validate_config
from hyflow.config import catalog as catalog_module
from hyflow.config.keys import lookup
from hyflow.config.roles import role_specs
from hyflow.config.schema import HyflowConfig
from hyflow.config.sft_schema import SFTConfig

HYFLOW = Path(hyflow.__file__).parent
# Files that name keys without using them: the schemas, the support tables, and the validator's checks.
NOT_USES = {*(f"config/schema/{p.name}" for p in (HYFLOW / "config" / "schema").glob("*.py")),
            *(f"config/checks/{p.name}" for p in (HYFLOW / "config" / "checks").glob("*.py")),
            "config/sft_schema.py", "config/support.py", "config/verl_compat.py", "config/validate.py",
            # the tool and interaction YAML loaders read their own files' `class_name`/`config` entries, never the
            # run config (they are given a path)
            "tools/registry.py", "interactions/registry.py",
            # the trackers' own settings (wandb/swanlab `mode`) and the plot's series objects (`.steps`); plot.py
            # reads a finished run's config.yaml only for the figure's title
            "trainer/tracking.py", "trainer/plot.py"}

# Reads the search cannot see, each with where it happens. Keep this list short and honest.
READ_WITHOUT_ATTRIBUTE = {
    # workers/actor.py passes the whole section as keyword arguments: **vars(actor.policy_loss)
    **dict.fromkeys(f"actor_rollout_ref.actor.policy_loss.{k}" for k in (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")),
    # trainer/rl_trainer.py hands the advantage estimator the algorithm knobs its signature names:
    # estimator_knobs(vars(algo), estimator) (hyflow.algos.registry), e.g. gae's gamma/lam, grpo's
    # norm_adv_by_std_in_grpo, gdpo's reward keys and weights
    **dict.fromkeys(f"algorithm.{k}" for k in ("gamma", "lam", "norm_adv_by_std_in_grpo", "gdpo_reward_keys",
                                                "gdpo_reward_weights", "reward_gt_coef", "reward_dpo_coef")),
    # SFT: config/verl_compat.py's fold_sft_dict_keys reads getattr(data, f"{kind}_dict_keys") (a support module,
    # so not searched)
    "data.prompt_dict_keys": None, "data.response_dict_keys": None,
    # config/lora.py's lora_settings reads every LoRA key as _get(section, "<key>") (a dataclass, dict or
    # DictConfig section); the workers and the SFT trainer call it on these sections
    **dict.fromkeys(f"{section}.{k}" for section in ("actor_rollout_ref.model", "critic.model", "model")
                    for k in ("lora_rank", "lora_adapter_path")),
}

# Keys that a validator decides instead of the table (it reports them in its own words), by schema.
DECIDED_BY_VALIDATE = {
    # bypass mode trains with the PPO clip loss; loss_type=reinforce there is "not supported" (config/checks/
    # rollout_correction.py), and without bypass_mode verl does not use it either.
    # PRIME's reward_model.model.ref_type has one choice, freeze, which is what hyflow.workers.prm does (a frozen
    # copy from ref_path); the schema's choices refuse any other value.
    "rl": {"algorithm.rollout_correction.loss_type", "reward_model.model.ref_type"},
    "sft": set(),
}
# Keys implemented by a change in flight (none now: data.custom_cls is read by hyflow/trainer/rl_trainer.py).
PENDING: set[str] = set()


def schema_leaves(cls: type) -> list[str]:
    """Every leaf key of a dataclass schema, dotted (`data.train_batch_size`, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += [f"{f.name}.{k}" for k in schema_leaves(type(default))]
        else:
            keys.append(f.name)
    return keys


# Modules that only one trainer runs: an RL key is not read by the SFT trainer, nor an SFT key by the RL stack.
SFT_ONLY = {"trainer/sft_trainer.py", "data/sft_dataset.py", "workers/sft.py"}
RL_ONLY = {"trainer/rl_trainer.py", "workers/actor.py", "workers/critic.py", "workers/reward_model.py",
           "config/arithmetic.py", "config/describe.py", "data/rl_dataset.py"}


@functools.cache
def hyflow_sources(schema: str | None = None) -> dict[str, str]:
    """hyflow's modules (without NOT_USES, and without the other trainer's own modules when `schema` is RL or
    SFT), comments and prose strings blanked: a key named in prose is no read."""
    skip = NOT_USES | {support.RL: SFT_ONLY, support.SFT: RL_ONLY}.get(schema, set())
    return {str(p.relative_to(HYFLOW)): code_only(p.read_text()) for p in HYFLOW.rglob("*.py")
            if str(p.relative_to(HYFLOW)) not in skip}


def code_only(text: str) -> str:
    """`text` without comments and with every string literal longer than an identifier emptied, so prose
    (docstrings, messages) cannot look like a read; short strings (`"len"`, dotted keys) stay for item reads."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and not re.fullmatch(r"[rbuRBU]?(['\"])[\w.]*\1", tok.string):
            out.append((tok.type, '""'))
        else:
            out.append((tok.type, tok.string))
    return tokenize.untokenize(out)


def reads(key: str, sources: Mapping[str, str], shared: bool) -> bool:
    """Whether some source reads `key` (see the module docstring for what counts)."""
    parts = key.split(".")
    leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else None
    # `.leaf` not followed by a call or a quote: an attribute read, not a method or a file name ("x_reaper.log")
    use = re.compile(rf"\.\s*{leaf}\b(?!\s*\()(?!['\"])|\[\s*['\"]{leaf}['\"]\s*\]|\.\s*get\s*\(\s*['\"]{leaf}['\"]"
                     rf"|getattr\s*\([^,()]+,\s*['\"]{leaf}['\"]")
    for text in sources.values():
        if f'"{key}"' in text or f"'{key}'" in text:
            return True
        if not use.search(text):
            continue
        if not shared or parent is None or re.search(rf"\b{parent}\b", text):
            return True
    return False


def reads_through_section(key: str, sources: Mapping[str, str]) -> bool:
    """The strict form: `<section>.<leaf>` (e.g. `data.tokenizer`) or the dotted key string in some source."""
    parent, leaf = key.split(".")[-2:]
    pattern = re.compile(rf"\b{parent}\s*\.\s*{leaf}\b(?!\s*\()")
    return any(pattern.search(t) or f'"{key}"' in t or f"'{key}'" in t for t in sources.values())


def unclassified(keys: Iterable[str], table_keys: set[str], sources: Mapping[str, str],
                 shared_names: Counter) -> list[str]:
    """The keys that are neither in the table, nor allowed by name, nor read by the sources."""
    return [k for k in keys if k not in table_keys and k not in READ_WITHOUT_ATTRIBUTE and k not in PENDING
            and not reads(k, sources, shared_names[k.split(".")[-1]] > 1)]


def _all_leaves() -> tuple[list[str], list[str], Counter]:
    rl, sft = schema_leaves(HyflowConfig), schema_leaves(SFTConfig)
    return rl, sft, Counter(k.split(".")[-1] for k in set(rl) | set(sft))


def _table_keys(schema: str) -> set[str]:
    return {e.key for e in support.table() if e.schema == schema} | DECIDED_BY_VALIDATE[schema]


# ------------------------------------------------------------------------------------- the walk


def test_every_rl_and_sft_leaf_is_read_rejected_or_performance_only():
    rl, sft, names = _all_leaves()
    stale = [k for k in [*READ_WITHOUT_ATTRIBUTE, *PENDING] if k not in rl and k not in sft]
    stale += [k for k in DECIDED_BY_VALIDATE["rl"] if k not in rl] + [k for k in DECIDED_BY_VALIDATE["sft"] if k not in sft]
    assert not stale, f"allow-list entries that are no schema leaves: {stale}"
    silent = (unclassified(rl, _table_keys(support.RL), hyflow_sources(support.RL), names)
              + [f"(sft) {k}" for k in unclassified(sft, _table_keys(support.SFT), hyflow_sources(support.SFT), names)])
    assert not silent, (
        "config keys that nothing reads and hyflow/config/support.py does not declare (read them, or add them "
        f"to the table as not supported / performance-only): {silent}")


def test_the_walk_reports_a_leaf_nothing_reads():
    @dataclasses.dataclass
    class Inner:
        train_batch_size: int = 1  # read all over hyflow
        zz_never_read_knob: int = 0

    @dataclasses.dataclass
    class Fake:
        data: Inner = dataclasses.field(default_factory=Inner)

    keys = schema_leaves(Fake)
    assert keys == ["data.train_batch_size", "data.zz_never_read_knob"]
    assert unclassified(keys, set(), hyflow_sources(), Counter()) == ["data.zz_never_read_knob"]
    assert unclassified(keys, {"data.zz_never_read_knob"}, hyflow_sources(), Counter()) == []


def test_a_shared_leaf_name_counts_only_where_its_section_is_named():
    sources = {"a.py": "x = cfg.critic.model\ny = m.external_lib\n", "b.py": "z = actor.external_lib\n"}
    assert reads("critic.model.external_lib", sources, shared=True)
    assert not reads("reward_model.model.external_lib", {"b.py": sources["b.py"]}, shared=True)
    assert reads("reward_model.model.external_lib", {"b.py": sources["b.py"]}, shared=False)
    assert reads("reward_model.overlong_buffer.enable", {"m.py": 'self.overlong_buffer.get("enable")'}, shared=True)


def lying_entries(entries: Iterable[support.KeySupport], leaves: Mapping[str, set[str]],
                  sources_for: Callable[[str], Mapping[str, str]]) -> list[str]:
    """Table entries that the sources read: the table would lie about them.

    Detectable where the leaf name is unique, or where every leaf of that name is in the table (the four FSDP
    sections' param_offload: a read of any of them contradicts an entry). Leaf names that are also common
    attributes of other objects (self.tokenizer, str.format) need their section written out. A not-supported
    entry with a predicate allows some values (ulysses size 1, fsdp_size -1), which the code reads and honours,
    and a performance-only entry with a predicate is ignored only where the predicate holds (the vllm knobs while
    rollout.name=hf; the vllm engine reads them), so only entries without a predicate are checked."""
    entries = list(entries)
    names = Counter(k.split(".")[-1] for ks in leaves.values() for k in set(ks))
    declared = {(e.schema, e.key) for e in entries}
    all_declared = {leaf for leaf in names if all((schema, k) in declared for schema, ks in leaves.items()
                                                  for k in ks if k.split(".")[-1] == leaf)}
    lying = []
    for e in (e for e in entries if e.asked is None):
        leaf, sources = e.key.split(".")[-1], sources_for(e.schema)
        if leaf in {"tokenizer", "format"}:
            lying += [e.key] if reads_through_section(e.key, sources) else []
        elif names[leaf] == 1 or leaf in all_declared:
            lying += [e.key] if reads(e.key, sources, shared=names[leaf] > 1) else []
    return lying


def test_the_lie_check_reports_a_declared_key_that_code_reads():
    entries = [support.KeySupport("data.dataloader_num_workers", support.PERFORMANCE_ONLY, "test"),
               support.KeySupport("a.fsdp_config.param_offload", support.PERFORMANCE_ONLY, "test"),
               support.KeySupport("b.fsdp_config.param_offload", support.PERFORMANCE_ONLY, "test")]
    leaves = {support.RL: {"data.dataloader_num_workers", "a.fsdp_config.param_offload",
                           "b.fsdp_config.param_offload"}, support.SFT: set()}
    quiet = {"x.py": "loader = make(cfg.data.shuffle)\n"}
    assert lying_entries(entries, leaves, lambda schema: quiet) == []
    reader = {"x.py": "n = cfg.data.dataloader_num_workers\nif fsdp_config.param_offload: pass\n"}
    assert lying_entries(entries, leaves, lambda schema: reader) == [e.key for e in entries]


def test_table_entries_name_schema_leaves_or_keys_beside_them_and_do_not_lie():
    rl, sft, _ = _all_leaves()
    leaves = {support.RL: set(rl), support.SFT: set(sft)}
    schemas = {support.RL: HyflowConfig, support.SFT: SFTConfig}
    # a key the schema does not hold lies in a section (or in a section of its own), never below a schema leaf
    below_a_leaf = [e.key for e in support.table() if not support.in_schema(e, schemas[e.schema])
                    and any(".".join(e.key.split(".")[:i]) in leaves[e.schema] for i in range(1, e.key.count(".") + 1))]
    assert not below_a_leaf, f"support-table entries below a single-valued schema key: {below_a_leaf}"
    for e in support.table():
        if not support.in_schema(e, schemas[e.schema]):
            with pytest.raises(ConfigError):
                lookup(e.key, schema=schemas[e.schema])
    outside = {s: set(support.outside_keys(schemas[s])) for s in schemas}
    lying = lying_entries(support.table(), {s: leaves[s] | outside[s] for s in leaves}, hyflow_sources)
    assert not lying, f"declared not supported / performance-only, yet read by hyflow's code: {lying}"


# Table entries whose keys stay schema leaves: the code reads them (the reward model's reshard_after_forward is a
# field of the FSDP section every role shares; the SFT engine's dtype and reshard_after_forward feed its engine), or
# the entry's predicate needs the key's value next to values hyflow reads (LoRA knobs while LoRA is off, vllm knobs
# under the hf engine, HSDP sizes, ...: every entry with a predicate).
SCHEMA_LEAVES_IN_TABLE = {(support.RL, "reward_model.model.fsdp_config.reshard_after_forward"),
                          (support.SFT, "engine.dtype"), (support.SFT, "engine.reshard_after_forward")}


def test_the_table_and_the_schema_do_not_overlap():
    schemas = {support.RL: HyflowConfig, support.SFT: SFTConfig}
    overlap = {(e.schema, e.key) for e in support.table() if support.in_schema(e, schemas[e.schema]) and e.asked is None}
    assert overlap == SCHEMA_LEAVES_IN_TABLE, (
        "table entries without a predicate whose keys are schema leaves (remove the leaf, or list it here with "
        f"the code that reads it): {sorted(overlap - SCHEMA_LEAVES_IN_TABLE)}; listed but gone: "
        f"{sorted(SCHEMA_LEAVES_IN_TABLE - overlap)}")
    for root in schemas.values():
        for key in support.outside_keys(root):
            support.verl_default(key)  # every key outside the schema has verl's default (KeyError otherwise)


def test_a_key_has_one_kind_unless_its_predicates_split_it():
    kinds: dict[str, set[str]] = {}
    for e in support.table():
        kinds.setdefault(e.key, set()).add(e.kind)
    both = {k for k, v in kinds.items() if len(v) > 1}
    # engine_kwargs: the hf engine's arguments are refused, the other engines' are irrelevant; engine parallelism:
    # refused for vllm (not built), irrelevant for hf.
    assert both <= {"actor_rollout_ref.rollout.engine_kwargs", *(f"actor_rollout_ref.rollout.{k}" for k in (
        "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size",
        "pipeline_model_parallel_size"))}, both
    cfg = load_config(["+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"])
    entries = [e for e in support.table() if e.key == "actor_rollout_ref.rollout.engine_kwargs"]
    assert [e.kind for e in entries if support.is_asked(e, cfg)] == [support.PERFORMANCE_ONLY]


# ----------------------------------------------------------------------------- rejections


def _other_value(value):
    """A value that differs from `value` and has its type (None becomes a string)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "other"


@pytest.mark.parametrize("entry", [e for e in support.table() if e.asked is None], ids=lambda e: f"{e.schema}:{e.key}")
def test_every_entry_without_a_predicate_triggers_on_a_non_default_value(entry):
    root = {support.RL: HyflowConfig, support.SFT: SFTConfig}[entry.schema]
    cfg = root()
    assert support.not_supported_problems(cfg) == [] and support.performance_only_warning(cfg) is None
    if support.in_schema(entry, root):
        *path, leaf = entry.key.split(".")
        parent = support.lookup(cfg, ".".join(path)) if path else cfg
        setattr(parent, leaf, _other_value(getattr(parent, leaf)))
    else:  # what the loader records for a key the schema does not hold
        vars(cfg)[support.DECLARED] = {entry.key: support.verl_default(entry.key)}
        assert support.not_supported_problems(cfg) == [] and support.performance_only_warning(cfg) is None
        vars(cfg)[support.DECLARED] = {entry.key: _other_value(support.verl_default(entry.key))}
    problems, line = support.not_supported_problems(cfg), support.performance_only_warning(cfg) or ""
    if entry.kind == support.NOT_SUPPORTED:
        assert [p for p in problems if p.startswith(f"{entry.key} is not supported by this hyflow version yet")]
    else:
        assert problems == [] and f" {entry.key}=" in line and entry.reason in line


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.fsdp_config.seed=7"], "actor_rollout_ref.actor.fsdp_config.seed"),
    (["critic.model.fsdp_config.model_dtype=bf16"], "critic.model.fsdp_config.model_dtype"),
    (["data.tokenizer=/tok"], "data.tokenizer"),
    (["data.tool_config_path=tools.yaml"], "data.tool_config_path"),
    (["data.sampler.class_name=Curriculum"], "data.sampler.class_name"),
    (["actor_rollout_ref.hybrid_engine=false"], "actor_rollout_ref.hybrid_engine"),
    (["actor_rollout_ref.model.external_lib=my_models"], "actor_rollout_ref.model.external_lib"),
    (["critic.model.external_lib=my_models"], "critic.model.external_lib"),
    (["+actor_rollout_ref.rollout.engine_kwargs.hf.attn=sdpa"], "actor_rollout_ref.rollout.engine_kwargs"),
    (["critic.model.enable_activation_offload=true"], "critic.model.enable_activation_offload"),
    (["actor_rollout_ref.actor.optim.clip_grad=0.5"], "actor_rollout_ref.actor.optim.clip_grad"),
])
def test_keys_hyflow_cannot_honour_are_named_errors(overrides, key):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(overrides))
    text = str(info.value)
    assert f"{key} is not supported by this hyflow version yet (got " in text
    assert text.count("is not supported by this hyflow version yet") == 1, text


def test_defaults_and_allowed_values_are_not_rejected():
    validate_config(load_config([]))
    # fsdp_size at -1 or at the role's device count is plain FSDP; fp32 masters are what hyflow keeps.
    validate_config(load_config(["actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "trainer.n_gpus_per_node=2",
                                 "actor_rollout_ref.actor.fsdp_config.model_dtype=float32",
                                 "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]))
    # the clip hyflow applies is the role's grad_clip; optim.clip_grad may say the same
    validate_config(load_config(["actor_rollout_ref.actor.grad_clip=0.5", "critic.grad_clip=0.3",
                                 "critic.optim.clip_grad=0.3"]))


def test_sequence_parallel_sizes_are_accepted_and_checked():
    """Ulysses sequence parallelism is built (hyflow.models.ulysses): a size that divides the devices validates;
    one that does not, or one without packing, is a named problem."""
    validate_config(load_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_"
                                 "sequence_parallel_size=2", "trainer.n_gpus_per_node=2"]))
    with pytest.raises(ConfigError, match=r"actor.ulysses_sequence_parallel_size=3 must be >= 1 and divide the 2 "
                                          r"devices"):
        validate_config(load_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3",
                                     "trainer.n_gpus_per_node=2"]))
    with pytest.raises(ConfigError, match=r"critic.ulysses_sequence_parallel_size=2 needs sequence packing "
                                          r"\(critic.model.use_remove_padding=true"):
        validate_config(load_config(["critic.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
                                     "critic.model.use_remove_padding=false", "algorithm.adv_estimator=gae"]))


# ---------------------------------------------------------------------- performance-only keys


def test_performance_only_keys_are_named_in_one_line_only_when_set():
    assert support.performance_only_warning(load_config([])) is None
    cfg = load_config(["actor_rollout_ref.ref.fsdp_config.optimizer_offload=true",
                       "critic.model.fsdp_config.optimizer_offload=true",  # read: not named
                       "reward_model.model.fsdp_config.param_offload=true",
                       "actor_rollout_ref.model.use_fused_kernels=true",
                       "reward_model.launch_reward_fn_async=true",
                       "data.dataloader_num_workers=0",
                       "actor_rollout_ref.rollout.mode=sync",
                       "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
                       "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"])
    validate_config(cfg)
    line = support.performance_only_warning(cfg)
    assert line.startswith(support.WARNING_PREFIX) and "\n" not in line
    assert "critic.model.fsdp_config.optimizer_offload" not in line
    for key in ("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true",
                "reward_model.model.fsdp_config.param_offload=true",
                "actor_rollout_ref.model.use_fused_kernels=true",
                "reward_model.launch_reward_fn_async=true", "data.dataloader_num_workers=0",
                "actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
                "actor_rollout_ref.rollout.engine_kwargs="):
        assert key in line, key


def test_the_rl_trainer_prints_the_line_once_at_start(capsys):
    from hyflow.trainer.rl_trainer import RLTrainer

    with pytest.raises(ValueError, match="actor_rollout_ref.model.path"):  # stops before any model loads
        RLTrainer(["actor_rollout_ref.model.use_shm=true", "data.dataloader_num_workers=2"])
    out = capsys.readouterr().out
    assert out.count(support.WARNING_PREFIX) == 1
    assert "actor_rollout_ref.model.use_shm=true" in out and "data.dataloader_num_workers=2" in out


def test_the_sft_trainer_prints_its_line_once_before_loading(monkeypatch, capsys):
    from hyflow.trainer.sft_trainer import SFTTrainer

    entry = support.KeySupport("optim.weight_decay", support.PERFORMANCE_ONLY, "a test entry", None, support.SFT)
    monkeypatch.setattr(support, "table", lambda: (*support._merged_table(), entry))
    with pytest.raises(ConfigError, match="model.partial_pretrain"):  # stops before any model loads
        SFTTrainer(["optim.weight_decay=0.5"])
    out = capsys.readouterr().out
    assert out.count(support.WARNING_PREFIX) == 1 and "optim.weight_decay=0.5 (a test entry)" in out


def test_sft_rejects_a_not_supported_key_before_loading(monkeypatch):
    from hyflow.trainer.sft_trainer import SFTTrainer

    entry = support.KeySupport("data.seed", support.NOT_SUPPORTED, "a test entry", None, support.SFT)
    monkeypatch.setattr(support, "table", lambda: (*support._merged_table(), entry))
    with pytest.raises(ConfigError, match=r"data.seed is not supported by this hyflow version yet \(got 3\): a test"):
        SFTTrainer(["data.seed=3"])


def test_a_verl_gsm8k_grpo_command_line_passes_with_its_speed_knobs_named():
    # verl's examples/grpo_trainer/run_qwen2-7b.sh (legacy names), with entry point, paths, engine and sizes changed.
    cfg = load_config([
        "algorithm.adv_estimator=grpo", "data.train_batch_size=16", "data.max_prompt_length=64",
        "data.max_response_length=32", "data.filter_overlong_prompts=True", "data.truncation=error",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.device=cpu"])
    validate_config(cfg)
    line = support.performance_only_warning(cfg)
    assert "param_offload" not in line  # read: the reference lives in host memory between its log-prob passes
    assert role_specs(cfg).actor.ref.fsdp.param_offload
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" in line
    assert "fsdp_config.optimizer_offload" not in line  # left at the default: not named


# ----------------------------------------------------------------------------- implemented keys


def test_validation_shuffle_is_a_seeded_permutation():
    from hyflow.trainer.rl_trainer import validation_order

    assert validation_order(10, False, 3) == list(range(10))
    shuffled = validation_order(10, True, 3)
    assert sorted(shuffled) == list(range(10)) and shuffled != list(range(10))
    assert validation_order(10, True, 3) == shuffled  # the same order at every validation of a run
    assert validation_order(10, True, 4) != shuffled


# ----------------------------------------------------------------------------- registered names


def test_logger_reward_manager_and_engine_names_are_checked_at_config_time():
    with pytest.raises(ConfigError, match=r"unknown logger 'consol'.*Did you mean 'console'"):
        validate_config(load_config(["trainer.logger=[consol,file]"]))
    with pytest.raises(ConfigError, match=r"reward_model.reward_manager='naiv' is not one of: .*Did you mean 'naive'"):
        validate_config(load_config(["reward_model.reward_manager=naiv"]))
    with pytest.raises(ConfigError, match=r"rollout.name=sglang is not supported by this hyflow version yet"):
        validate_config(load_config(["actor_rollout_ref.rollout.name=sglang", "trainer.device=cuda"]))


@pytest.fixture
def missing_tracker_package(monkeypatch):
    """A component catalog whose wandb logger needs a package that no install has."""
    real = catalog_module.component_catalog()
    loggers = dict(real.loggers)
    loggers["wandb"] = ("hyflow_test_no_such_package", "pip install hyflow-test-no-such-package")
    fake = dataclasses.replace(real, loggers=loggers)
    monkeypatch.setattr(catalog_module, "_component_provider", lambda: fake)


def test_a_tracker_whose_package_is_missing_fails_at_config_time(missing_tracker_package):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(["trainer.logger=[console,wandb]"]))
    assert str(info.value) == ("trainer.logger includes 'wandb' but the hyflow_test_no_such_package package is not "
                               "installed: pip install hyflow-test-no-such-package, or remove wandb from trainer.logger")


def test_the_cli_reports_a_missing_tracker_in_one_line_before_loading_a_model(missing_tracker_package, capsys):
    from hyflow.cli import main

    # No model path is given: the run would fail on it later, so failing on the tracker proves the order.
    assert main(["train", "trainer.logger=[console,wandb]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hyflow_test_no_such_package package is not installed" in err
    assert "Traceback" not in err


def test_sft_checks_loggers_before_loading_the_model(missing_tracker_package):
    from hyflow.trainer.sft_trainer import SFTTrainer

    with pytest.raises(ConfigError, match="hyflow_test_no_such_package package is not installed"):
        SFTTrainer(["trainer.logger=[console,wandb]"])  # no model.partial_pretrain: it would fail later on that


@pytest.mark.slow
def test_validation_shuffle_changes_the_generation_order_of_a_run(tiny_model_dir, tmp_path):
    import json

    from hyflow.data.tasks import make_task
    from hyflow.trainer.rl_trainer import RLTrainer, validation_order

    make_task("arithmetic", tmp_path / "task", n_train=8, n_test=6, seed=0, digits=1)

    def val_inputs(run: str, *extra: str) -> list[str]:
        RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path}/task/train.parquet",
                   f"data.val_files={tmp_path}/task/test.parquet", f"trainer.default_local_dir={tmp_path / run}",
                   "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                   "data.max_prompt_length=48", "data.max_response_length=4", "data.val_batch_size=2",
                   "reward_model.num_workers=0", "trainer.logger=[file]", "trainer.val_only=true", "data.seed=5",
                   *extra]).fit()
        lines = (tmp_path / run / "generations" / "val_step_0.jsonl").read_text().splitlines()
        return [json.loads(line)["input"] for line in lines]

    in_file_order = val_inputs("plain")
    shuffled = val_inputs("shuffled", "data.validation_shuffle=true")
    assert sorted(shuffled) == sorted(in_file_order) and shuffled != in_file_order
    assert shuffled == [in_file_order[i] for i in validation_order(6, True, 5)]


# ------------------------------------------------------------------- verl keys ported by issue 22


@pytest.mark.parametrize("verl_key, value, hyflow_key, expected", [
    ("actor_rollout_ref.actor.use_remove_padding", "false", "actor_rollout_ref.model.use_remove_padding", False),
    ("actor_rollout_ref.actor.use_fused_kernels", "true", "actor_rollout_ref.model.use_fused_kernels", True),
    ("actor_rollout_ref.actor.rollout_n", "4", "actor_rollout_ref.rollout.n", 4),
    ("actor_rollout_ref.ref.rollout_n", "4", "actor_rollout_ref.rollout.n", 4),
    ("critic.rollout_n", "4", "actor_rollout_ref.rollout.n", 4),
    ("actor_rollout_ref.actor.optim.warmup_style", "cosine", "actor_rollout_ref.actor.optim.lr_scheduler_type",
     "cosine"),
    ("critic.optim.warmup_style", "cosine", "critic.optim.lr_scheduler_type", "cosine"),
    ("actor_rollout_ref.model.lora.rank", "8", "actor_rollout_ref.model.lora_rank", 8),
    ("actor_rollout_ref.model.lora.alpha", "32", "actor_rollout_ref.model.lora_alpha", 32),
    ("actor_rollout_ref.model.lora.target_modules", "[q_proj,v_proj]", "actor_rollout_ref.model.target_modules",
     ["q_proj", "v_proj"]),
    ("actor_rollout_ref.model.lora.exclude_modules", "[lm_head]", "actor_rollout_ref.model.exclude_modules",
     ["lm_head"]),
    ("actor_rollout_ref.model.lora.adapter_path", "/a", "actor_rollout_ref.model.lora_adapter_path", "/a"),
    ("critic.model.lora.rank", "4", "critic.model.lora_rank", 4),
])
def test_verl_plain_aliases_set_the_key_they_copy(verl_key, value, hyflow_key, expected):
    assert support.value_of(load_config([f"{verl_key}={value}"]), hyflow_key) == expected


def test_a_copy_given_beside_its_setting_with_another_value_is_an_error():
    load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.rollout_n=4"])  # the same: fine
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.rollout_n=8 and actor_rollout_ref.rollout.n=4"):
        load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.rollout_n=8"])


def test_sft_takes_the_nested_lora_names():
    cfg = load_config(["model.lora.rank=8", "model.lora.alpha=16"], schema=SFTConfig)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (8, 16)


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.rollout.over_sample_rate"),
    ("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3",
     "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts"),
    ("actor_rollout_ref.rollout.full_determinism=true", "actor_rollout_ref.rollout.full_determinism"),
    ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.nnodes"),
    ("actor_rollout_ref.actor.optim.zero_indexed_step=false", "actor_rollout_ref.actor.optim.zero_indexed_step"),
    ("critic.optim.zero_indexed_step=false", "critic.optim.zero_indexed_step"),
])
def test_ported_verl_keys_hyflow_cannot_honour_are_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=f"{key} is not supported by this hyflow version yet"):
        validate_config(load_config([override]))


def test_ported_verl_keys_at_verl_defaults_pass_silently():
    cfg = load_config(["actor_rollout_ref.rollout.over_sample_rate=0", "actor_rollout_ref.rollout.nnodes=0",
                       "actor_rollout_ref.rollout.n_gpus_per_node=8", "actor_rollout_ref.rollout.full_determinism=false",
                       "actor_rollout_ref.actor.optim.zero_indexed_step=true",
                       "actor_rollout_ref.rollout.scheduling_policy=fcfs", "actor_rollout_ref.model.lora.merge=false",
                       "reward_model.model.use_remove_padding=false"])
    validate_config(cfg)
    assert support.performance_only_warning(cfg) is None


def test_ported_speed_knobs_are_named_at_start():
    cfg = load_config(["actor_rollout_ref.rollout.scheduling_policy=priority", "actor_rollout_ref.model.lora.merge=true",
                       "reward_model.model.use_remove_padding=true",
                       "global_profiler.global_tool_config.nsys.controller_nsight_options.trace=cuda",
                       "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.wait=1",
                       "critic.profiler.tool_config.precision_debugger.strict=true"])
    validate_config(cfg)
    line = support.performance_only_warning(cfg)
    for key in ("actor_rollout_ref.rollout.scheduling_policy=priority", "actor_rollout_ref.model.lora.merge=true",
                "reward_model.model.use_remove_padding=true", "global_profiler.global_tool_config=",
                "actor_rollout_ref.actor.profiler.tool_config.torch.schedule=",
                "critic.profiler.tool_config.precision_debugger="):
        assert key in line, key


def test_validation_sampling_at_temperature_zero_is_greedy_with_one_note():
    cfg = load_config(["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=0"])
    with pytest.warns(UserWarning, match="validation decodes greedily") as record:
        validate_config(cfg)
    assert sum("greedily" in str(w.message) for w in record) == 1
    from hyflow.rollout.base import SamplingParams

    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert SamplingParams(temperature=val.temperature, do_sample=val.do_sample).greedy


def test_verl_engines_run_on_hyflows_and_refuse_what_cannot_map_by_name():
    """strategy / model_engine = megatron, veomni, torchtitan: the run validates on hyflow's FSDP2 engine, the start
    line says so and where the keys went, kernel knobs are performance-only, and what cannot map is refused by name."""
    from hyflow.config.support import engine_line
    from hyflow.workers.fsdp import parallel_strategy

    megatron = ["actor_rollout_ref.actor.strategy=megatron", "trainer.n_gpus_per_node=4",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.use_mbridge=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
                "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
                "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32"]
    cfg = load_config(megatron)
    validate_config(cfg)
    assert parallel_strategy(cfg.actor_rollout_ref.actor.strategy, 4) == "fsdp2"
    line = engine_line(cfg)
    assert line.startswith("hyflow: verl's megatron engine runs on hyflow's FSDP2 engine")
    assert "context_parallel_size -> ulysses_sequence_parallel_size" in line and "actor: tensor_parallel_size=2" in line
    accepted = support.performance_only_warning(cfg)
    for key in ("megatron.grad_offload=true",
                "override_transformer_config.recompute_granularity=full",
                "override_transformer_config.moe_router_dtype=fp32"):
        assert key in accepted, key
    assert engine_line(load_config(["model_engine=veomni"])).startswith("hyflow: verl's veomni engine")
    assert engine_line(load_config([])) is None
    # Megatron's pipeline sizes are hyflow's (tp 2 x pp 2 = the 4 devices), the stage-split knobs performance-only
    cfg = load_config([*megatron, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                       "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                       "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=3"])
    validate_config(cfg)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.pipeline_parallel_size, actor.virtual_pipeline_parallel_size) == (2, 2)
    assert "actor: tensor_parallel_size=2, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2" in engine_line(cfg)
    assert "num_layers_in_first_pipeline_stage=3 (verl's megatron engine knob: how the layers" in \
        support.performance_only_warning(cfg)
    for extra, problem in (
            ("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
             "virtual_pipeline_parallel_size=2 needs actor_rollout_ref.actor.pipeline_parallel_size > 1"),
            ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
             "splitting each expert over tensor-parallel ranks is not built"),
            ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=true", "not from a Megatron distributed"),
            ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
             "moe_aux_loss_coeff is not supported by this hyflow version yet (got 0.01)"),
            ("actor_rollout_ref.actor.megatron.router_replay.mode=R2", "router replay"),
            ("actor_rollout_ref.actor.veomni.router_replay.mode=R3", "router replay"),
            ("actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "enable_rollout_routing_replay is not "
                                                                            "supported"),
            ("actor_rollout_ref.actor.veomni.mixed_precision=false", "fsdp_config.dtype=float32"),
            ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16", "reduces gradients in fp32")):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            validate_config(load_config([*megatron, extra]))
    validate_config(load_config([*megatron, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                                 "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"]))


def test_pipeline_parallel_sizes_are_checked_and_what_a_pipeline_does_not_run_is_refused_by_name():
    """pipeline_parallel_size: pp x tp divides the role's devices; FSDP2; the schedule fits the virtual stages;
    Ulysses and LoRA refused by name; packing and prompt sharing performance-only (said at start);
    a pipeline's data-parallel size is devices / (pp x tp) in the batch arithmetic."""
    from hyflow.config import batch_arithmetic

    base = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.pipeline_parallel_size=2"]
    cfg = load_config(base)
    validate_config(cfg)
    assert batch_arithmetic(cfg).actor.dp_size == 2
    line = support.performance_only_warning(cfg)
    assert "actor_rollout_ref.model.use_remove_padding=true (pipeline parallelism runs the padded" in line
    assert "actor_rollout_ref.actor.use_prefix_grouper=true (hyflow shares a prompt among its samples inside packed" in line
    assert support.performance_only_warning(load_config([])) is None or "pipeline" not in \
        support.performance_only_warning(load_config([]))
    validate_config(load_config([*base, "critic.pipeline_parallel_size=4", "algorithm.adv_estimator=gae",
                                 "actor_rollout_ref.actor.virtual_pipeline_parallel_size=2"]))
    for extra, problem in (
            ("actor_rollout_ref.actor.tensor_parallel_size=4",
             "pipeline_parallel_size=2 x actor_rollout_ref.actor.tensor_parallel_size=4 must divide the role's 4"),
            ("actor_rollout_ref.actor.strategy=ddp", "with actor_rollout_ref.actor.strategy=ddp (needs fsdp or fsdp2"),
            ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
             "with actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 (the pipeline runs padded"),
            ("actor_rollout_ref.model.lora_rank=8", "pipeline_parallel_size=2 with LoRA is not built yet"),
            ("actor_rollout_ref.actor.pipeline_schedule=Interleaved1F1B",
             "pipeline_schedule=Interleaved1F1B with virtual_pipeline_parallel_size=1"),
            ("actor_rollout_ref.actor.pipeline_schedule=ZB", "pipeline_schedule")):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            validate_config(load_config([*base, extra]))


def test_tensor_parallel_sizes_are_accepted_and_checked():
    """Tensor parallelism of the training engine: a size that divides the devices validates (for every role);
    one that does not is a named problem."""
    validate_config(load_config(["actor_rollout_ref.actor.tensor_parallel_size=2", "critic.tensor_parallel_size=2",
                                 "trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae",
                                 "actor_rollout_ref.actor.use_kl_loss=true"]))
    with pytest.raises(ConfigError, match=r"critic.tensor_parallel_size=3 must be >= 1 and divide the 2 devices"):
        validate_config(load_config(["critic.tensor_parallel_size=3", "trainer.n_gpus_per_node=2"]))
