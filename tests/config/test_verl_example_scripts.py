"""verl 0.10's own RL example scripts, ported to hyflow and checked by its config loader: how many validate.

What is counted. verl-project/verl at 1dda039 (the 0.10 line: `verl/version/version` is 0.10.0.dev) has 109
`examples/**/*.sh`. 91 launch `-m verl.trainer.main_ppo...` and all 91 are ported: 90 run
`verl.trainer.main_ppo`, 1 (`remax_trainer/run_qwen2.5_math_7b_sync_fsdp.sh`) runs `verl.trainer.main_ppo_sync`,
verl's synchronous TransferQueue trainer, on the same `ppo_trainer` config. The other 18 are not RL `main_ppo`
runs: 14 SFT scripts (`torchrun -m verl.trainer.sft_trainer`), 1 SFT through `-m verl_mlite.launch`, the
generation server (`examples/generation/`), `-m verl.experimental.fully_async_policy.fully_async_main`
(`mtp_trainer/..._fully_async_megatron_multinode.sh`) and a stub that only prints where its script moved
(`grpo_trainer/run_deepseek_v4_megatron_lite.sh`). Of the 91, 7 pass Hydra's `--config-name`: 3 name
`ppo_megatron_trainer.yaml` (verl's Megatron trainer config), 4 VeOmni scripts name `ppo_trainer` (verl's
default). Issue 39's "82" is not defined there and no verl commit has 82 such scripts; the 91 less the 9
Ascend-NPU-only ones (`examples/ascend_extras/**`: 7, `profile/run_qwen3_8b_npu_profile_{discrete,e2e}.sh`: 2)
is exactly 82, and that reading is the second ratchet here (`NPU_ONLY`, `VALIDATING_OF_82_AT_LEAST`). (The 91
less the 8 VeOmni scripts and the `main_ppo_sync` one is 82 too.)

The copy. tests/fixtures/verl_examples/*.txt hold the scripts' command lines, written once by
tools/port_verl_scripts.py: bash expands each script with an empty environment, so every `${VAR:-default}` is
the script's default (DEVICE=gpu, INFER_BACKEND=vllm unless the script says otherwise), and a variable with no
default is the placeholder `__NAME__` (that tool's docstring has the details). One shell word a line after a
`# key: value` header (source, verl commit, launcher, Hydra flags, what was substituted). This test reads only
those files.

The port: one rule. Changed is what no CPU machine here could run as written, and nothing else: no sizes, no
batch arithmetic, no GPU counts (`validate_config` checks against nnodes x n_gpus_per_node as written).
- The entry point: `[uv run ...] python3 -m verl.trainer.main_ppo[_sync]` -> `load_config` then
  `validate_config`, the checks `hyflow train` runs before it starts.
- `--config-path ./config --config-name NAME` goes through `config_file_from_hydra_flags` and
  `verl_config_overrides` as on hyflow's command line: verl's own `ppo_trainer` (a file inside verl's package)
  is hyflow's defaults, `ppo_megatron_trainer` is them with `model_engine=megatron`.
- Model paths and hub ids (`actor_rollout_ref.model.path`, `critic.model.path`,
  `reward.reward_model.model_path`, `distillation.teacher_models.*.model_path`) -> the tests' tiny local model;
  every `*.parquet` in `data.train_files` / `data.val_files` -> a local parquet file of that split;
  `trainer.default_local_dir` -> a temporary directory.
- `trainer.device` (unset = cuda, `npu` where a script sets it) -> `cpu`.
- The engine name `vllm` (`*.rollout.name`, `distillation.teacher_models.*.inference.name`) -> `hf`: this venv
  has no vLLM, and hyflow's vllm engine needs the package installed (its own check says so): a matter of the
  machine, not of the config. `sglang` and `trtllm` stay: hyflow has not built them.
Other paths (reward functions and dataset classes inside verl's repository, profiler and checkpoint folders,
`__HOME__`-style placeholders elsewhere) stay as written: the checks do not open them.

Validating means the config checks pass (what `hyflow train` runs before it loads a model). Two Megatron scripts
that validate with pipeline parallelism train vision-language models (grpo_trainer/run_qwen2_5_vl_7b_megatron,
run_qwen3_vl_8b_megatron): their run would stop at model load, where the engine refuses a vision-language model's
pipeline stages by name (not built yet); the checks do not read the model.

What is recorded. `VALIDATING_AT_LEAST` is a ratchet: how many of the 91 validate today. Every script that does
not validate is in `FAILING` with one named cause of `CAUSES` (the first in CAUSES' order whose pattern its
error shows: a script lacking several features is filed under the biggest), and its error must still match
that cause's pattern. When a hyflow change makes a FAILING script validate, or changes why it fails, its
`test_script` fails and says what to edit here (remove it from FAILING and raise the ratchets, or record the new
cause); a script that validated and no longer does fails the same way.
"""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

from hyflow.config import load_config, validate_config
from hyflow.config.loader import config_file_from_hydra_flags, verl_config_overrides

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "verl_examples"
SCRIPTS = sorted(p.stem for p in FIXTURES.glob("*.txt"))

PORTED = 91
VALIDATING_AT_LEAST = 60  # the ratchet: raise it when a script starts to validate, never lower it
VALIDATING_OF_82_AT_LEAST = 56  # the same over the 82 that are not Ascend-NPU-only (NPU_ONLY below)

# The Ascend-NPU-only scripts: the 91 less these 9 are the "82" of issue 39 (see the docstring).
NPU_ONLY = (*(s for s in SCRIPTS if s.startswith("ascend_extras__")),
            "profile__run_qwen3_8b_npu_profile_discrete", "profile__run_qwen3_8b_npu_profile_e2e")

# name: (pattern of hyflow's error message, what hyflow would need for it). In priority order: a script is filed
# under the first cause its error shows.
CAUSES: dict[str, tuple[str, str]] = {
    "pipeline_x_sequence_parallel": (
        r"pipeline_parallel_size=\d+ with actor_rollout_ref\.actor\.ulysses_sequence_parallel_size=\d+ .*is not built yet",
        "pipeline parallelism with context (Ulysses) parallelism: the pipeline runs padded micro-batches, Ulysses "
        "cuts packed ones"),
    "megatron_transformer_override": (
        r"unknown config key '[\w.]+\.megatron\.override_transformer_config\.\w+'",
        "Megatron TransformerConfig overrides hyflow has no entry for (model-shape keys such as "
        "normalization/swiglu, or knobs not yet classified)"),
    "megatron_dist_checkpoint": (
        r"megatron\.use_dist_checkpointing is not supported",
        "initial weights from a Megatron distributed checkpoint (use_dist_checkpointing)"),
    "moe_aux_loss": (
        r"moe_aux_loss_coeff is not supported",
        "a MoE load-balancing / z-loss term in the actor's loss "
        "(override_transformer_config.moe_aux_loss_coeff / moe_z_loss_coeff)"),
    "router_replay": (
        r"(router_replay\.mode is not supported|enable_rollout_routing_replay is not supported)",
        "MoE router replay (R2 / R3; issue 39 §2)"),
    "megatron_lite": (
        r"override 'actor@actor_rollout_ref\.actor=mlite_actor' uses a Hydra package \(@\)",
        "Megatron Lite: a Hydra config-group override (actor@actor_rollout_ref.actor=mlite_actor, "
        "hydra.searchpath=[pkg://verl_mlite.config]) selecting an out-of-tree engine"),
    "mtp": (
        r"'actor_rollout_ref\.model\.mtp\.\w+' is a verl key that hyflow does not support yet",
        "multi-token prediction (model.mtp.*): training and speculative decoding with MTP heads"),
    "lora_init_method": (
        r"'actor_rollout_ref\.model\.lora\.lora_A_init_method' is a verl key",
        "verl's Megatron LoRA init knob (model.lora.lora_A_init_method)"),
    "verl_script_role_model_engine": (
        r"unknown config key 'actor_rollout_ref\.actor\.model_engine'",
        "the script sets actor_rollout_ref.actor.model_engine, a key verl's own config does not have either "
        "(verl's Hydra would refuse it too: model_engine is top-level)"),
    "rollout_moe_tensor_parallel": (
        r"unknown config key 'actor_rollout_ref\.rollout\.moe_tensor_parallel_size'",
        "rollout.moe_tensor_parallel_size, a key of no verl config hyflow knows (verl 0.10's rollout config lacks it)"),
    "fsdp_turbo": (
        r"'actor_rollout_ref\.(actor|ref)\.fsdp_config\.turbo_config\.[\w.]+' is a verl key",
        "verl's FSDP turbo engine settings (fsdp_config.turbo_config.distributed.*/memory.*)"),
    "fsdp_reduce_dtype_bf16": (
        r"mixed_precision\.reduce_dtype is not supported by this hyflow version yet \(got bf16\)",
        "fsdp_config.mixed_precision.reduce_dtype=bf16 (gradient reduction in bf16)"),
    "sglang": (
        r"actor_rollout_ref\.rollout\.name=sglang is not supported",
        "the SGLang rollout engine (rollout.name=sglang)"),
    "sglang_engine_kwargs": (
        r"'actor_rollout_ref\.rollout\.engine_kwargs\.sglang\.\w+' is not in the config yet",
        "engine_kwargs.sglang.attention_backend set without '+' (hyflow's engine_kwargs.sglang is free-form); "
        "the script's rollout is sglang, so the SGLang engine too"),
    "rollout_is_threshold_string": (
        r"algorithm\.rollout_correction\.rollout_is_threshold='[^']*' \(a str\) is not a valid float",
        "rollout_correction.rollout_is_threshold as verl's 'lower_upper' string (verl: str | float); the "
        "script is a Megatron one too"),
    "rollout_correction_reinforce": (
        r"algorithm\.rollout_correction\.loss_type='reinforce' is not supported",
        "rollout_correction.loss_type=reinforce (bypass mode with the REINFORCE loss)"),
    "fsdp_model_dtype_bf16": (
        r"fsdp_config\.model_dtype is not supported by this hyflow version yet \(got bf16\)",
        "fsdp_config.model_dtype=bf16 (bf16 master weights)"),
}

# script (fixture stem): cause, grouped in CAUSES' order. 31 of the 91.
FAILING: dict[str, str] = {
    "ascend_extras__grpo_trainer__run_qwen3_5_122b_a10b_32k_megatron": "pipeline_x_sequence_parallel",
    "grpo_trainer__run_qwen3_vl_235b_a22b_megatron": "pipeline_x_sequence_parallel",
    "ascend_extras__grpo_trainer__run_qwen3_235b_256k_megatron": "megatron_transformer_override",
    "ascend_extras__grpo_trainer__run_qwen3_30b_a3b_megatron": "megatron_dist_checkpoint",
    "grpo_trainer__run_moonlight_16b_a3b_megatron": "megatron_dist_checkpoint",
    "grpo_trainer__run_qwen3_5_35b_megatron": "moe_aux_loss",
    "grpo_trainer__run_qwen3_5_397b_megatron": "moe_aux_loss",
    "grpo_trainer__run_qwen3_vl_30b_a3b_megatron": "moe_aux_loss",
    "grpo_trainer__run_deepseek_v4_flash_megatron": "router_replay",
    "router_replay__run_qwen3_5_35b_a3b_veomni": "router_replay",
    "grpo_trainer__run_deepseek_v4_veomni": "router_replay",
    "grpo_trainer__run_kimi_k2_6_glm5_1_megatron_lite": "megatron_lite",
    "grpo_trainer__run_qwen3_5_35b_megatron_lite": "megatron_lite",
    "mtp_trainer__run_mimo_7b_mtp_megatron": "mtp",
    "mtp_trainer__run_mimo_7b_mtp_rl_vllm_sgl_megatron": "mtp",
    "tuning__lora__run_qwen3_30b_a3b_megatron": "lora_init_method",
    "router_replay__run_qwen3_30b_a3b_megatron": "verl_script_role_model_engine",
    "tuning__scaling__run_qwen2_5_32b_megatron": "verl_script_role_model_engine",
    "grpo_trainer__run_qwen3_30b_a3b_megatron": "rollout_moe_tensor_parallel",
    "grpo_trainer__run_qwen3_5_27b_fsdp_turbo": "fsdp_turbo",
    "grpo_trainer__run_qwen3_5_35b_fsdp_turbo": "fsdp_turbo",
    "ascend_extras__grpo_trainer__run_qwen3_32b_fsdp": "fsdp_reduce_dtype_bf16",
    "ascend_extras__grpo_trainer__run_qwen3_next_80b_fsdp": "fsdp_reduce_dtype_bf16",
    "grpo_trainer__run_qwen3_next_80b_a3b_fsdp": "fsdp_reduce_dtype_bf16",
    "grpo_trainer__run_qwen3_5-122b-a10b_veomni": "sglang",
    "grpo_trainer__run_qwen3_5_35b_a3b_veomni": "sglang",
    "profile__run_qwen2_5_vl_7b_torch_memory": "sglang",
    "grpo_trainer__run_gpt_oss_20b_fsdp": "sglang_engine_kwargs",
    "grpo_trainer__run_hy_v3_megatron": "rollout_is_threshold_string",
    "rollout_correction__run_qwen2_5_7b_fsdp": "rollout_correction_reinforce",
    "tuning__lora__run_qwen3_8b_merge_fsdp": "fsdp_model_dtype_bf16",
}


def read_fixture(stem: str) -> tuple[dict[str, str], list[str]]:
    """({header field: value}, the arguments main_ppo receives) of one fixture."""
    header: dict[str, str] = {}
    words: list[str] = []
    for line in (FIXTURES / f"{stem}.txt").read_text().splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].strip().partition(": ")
            header.setdefault(key, value)
        elif line.strip():
            words += shlex.split(line)
    return header, words


MODEL_PATH_KEY = re.compile(r"(actor_rollout_ref\.model\.path|critic\.model\.path|reward\.reward_model\.model_path"
                            r"|distillation\.teacher_models\.[^.=]+\.model_path)")
ENGINE_NAME_KEY = re.compile(r"(.*\.rollout\.name|distillation\.teacher_models\.[^.=]+\.inference\.name)")
PARQUET = re.compile(r"[^'\",\[\]\s]+\.parquet")


def port(words: list[str], local: dict[str, Path]) -> list[str]:
    """The overrides with the docstring's substitutions (paths, device, engine name vllm) and nothing else."""
    ported = []
    for word in words:
        spelled, eq, value = word.partition("=")
        key = spelled.lstrip("+~")
        if not eq:
            pass
        elif MODEL_PATH_KEY.fullmatch(key):
            word = f"{spelled}={local['model']}"
        elif key in ("data.train_files", "data.val_files"):
            split = "train" if key == "data.train_files" else "test"
            word = f"{spelled}={PARQUET.sub(str(local[split]), value)}"
        elif key == "trainer.default_local_dir":
            word = f"{spelled}={local['run']}"
        elif key == "trainer.device":
            continue  # set below
        elif ENGINE_NAME_KEY.fullmatch(key) and value == "vllm":
            word = f"{spelled}=hf"
        ported.append(word)
    return [*ported, "trainer.device=cpu"]


def config_file(header: dict[str, str]) -> Path | None:
    """Hydra's --config-path/--config-name: verl's own `ppo_trainer` is hyflow's defaults (dropped); any other
    name is looked up as hyflow's command line looks it up."""
    return config_file_from_hydra_flags(header.get("config-path"), header.get("config-name"))


def outcome(stem: str, local: dict[str, Path]) -> str | None:
    """None when the ported script loads and validates; else hyflow's error message."""
    header, words = read_fixture(stem)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # advisories are not failures
            extra = verl_config_overrides(header.get("config-path"), header.get("config-name")) or []
            validate_config(load_config([*extra, *port(words, local)], config_file(header)))
    except Exception as exc:  # any error is the script's outcome, recorded by its message
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def outcomes(tiny_model_dir, tmp_path_factory) -> dict[str, str | None]:
    from hyflow.data.tasks import make_task

    data = make_task("arithmetic", tmp_path_factory.mktemp("verl_examples_data"), n_train=8, n_test=4, seed=0,
                     digits=1)
    local = {"model": tiny_model_dir, "train": data["train"], "test": data["test"],
             "run": tmp_path_factory.mktemp("verl_examples_run")}
    return {stem: outcome(stem, local) for stem in SCRIPTS}


def test_every_script_is_ported_and_every_failure_is_recorded():
    assert len(SCRIPTS) == PORTED, f"{len(SCRIPTS)} fixtures in {FIXTURES}, expected {PORTED}"
    assert not set(FAILING) - set(SCRIPTS), f"FAILING names no fixture: {sorted(set(FAILING) - set(SCRIPTS))}"
    assert not set(FAILING.values()) - set(CAUSES), "FAILING uses a cause CAUSES does not define"
    assert set(CAUSES) <= set(FAILING.values()), f"causes no script has: {set(CAUSES) - set(FAILING.values())}"
    assert PORTED - len(FAILING) >= VALIDATING_AT_LEAST


def test_ratchet(outcomes):
    validating = sorted(s for s, message in outcomes.items() if message is None)
    assert len(validating) >= VALIDATING_AT_LEAST, (
        f"{len(validating)}/{PORTED} of verl's example scripts validate, fewer than the {VALIDATING_AT_LEAST} "
        "recorded; the scripts that broke fail their own test below")


def test_count_on_the_issues_82(outcomes):
    """The same ratchet over the 82 scripts that are not Ascend-NPU-only (one reading of issue 39's 82)."""
    assert len(NPU_ONLY) == 9
    rest = [s for s in SCRIPTS if s not in NPU_ONLY]
    assert len(rest) == 82
    assert len([s for s in rest if s not in FAILING]) >= VALIDATING_OF_82_AT_LEAST
    validating = len([s for s in rest if outcomes[s] is None])
    assert validating >= VALIDATING_OF_82_AT_LEAST, (
        f"{validating}/82 of the scripts that are not NPU-only validate, fewer than {VALIDATING_OF_82_AT_LEAST}")


@pytest.mark.parametrize("stem", SCRIPTS)
def test_script(outcomes, stem):
    message = outcomes[stem]
    cause = FAILING.get(stem)
    if cause is None:
        assert message is None, f"verl's {stem} validated before and fails now:\n{message}"
        return
    if message is None:
        also = " and VALIDATING_OF_82_AT_LEAST by one" if stem not in NPU_ONLY else ""
        pytest.fail(f"verl's {stem} validates now: remove it from FAILING (cause {cause!r}) and raise "
                    f"VALIDATING_AT_LEAST to {PORTED - len(FAILING) + 1}{also} in {Path(__file__).name}")
    pattern, _ = CAUSES[cause]
    assert re.search(pattern, message), (
        f"verl's {stem} no longer fails with its recorded cause {cause!r} ({pattern}); it fails with:\n{message}\n"
        "record its new cause in FAILING (a new entry of CAUSES if none fits)")
