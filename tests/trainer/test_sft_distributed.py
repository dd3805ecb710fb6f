"""Multi-device SFT: `hyflow sft trainer.n_gpus_per_node=2` trains on 2 Ray workers (CPU, gloo, FSDP2) exactly as
one process does, checkpoints resume across world sizes (2 -> 1 and 1 -> 2) and export to transformers; batch
sizes that do not divide over the devices are config errors that name the keys and the fix."""

from __future__ import annotations

import pytest
import torch

from hyflow.cli import main
from hyflow.config.keys import ConfigError
from hyflow.config.sft_schema import load_sft_config
from hyflow.trainer.checkpoint import CheckpointManager, read_manifest
from hyflow.trainer.sft_trainer import SFTTrainer, run_sft
from hyflow.trainer.tracking import read_metrics

STEPS = 3
COMPARED = ("train/loss", "train/grad_norm", "train/lr", "val/loss")
# 2 workers against one process, measured (float32 summation order): losses differ by <= 3e-7, the gradient norm
# (about 3-7) by <= 1.2e-6 relative, the weights after 3 steps by <= 2e-6, while those steps move weights by up to
# 7.6e-3 (lr 3e-3). The tolerances sit 15-50x above the noise and 75x below one step's movement.
LOSS_ATOL, GRAD_NORM_RTOL, WEIGHT_ATOL = 1e-5, 2e-5, 1e-4


def overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"model.partial_pretrain={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"data.val_files={task_dir}/test.parquet", "data.val_max_samples=7",  # 7 rows: padded for 2 workers
        "data.response_key=extra_info.answer", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
        "model.enable_gradient_checkpointing=false", "optim.lr=3e-3", "optim.lr_warmup_steps=1",
        # AdamW's eps 1e-8 would divide a ~1e-9 gradient entry, whose rounding differs between 2 workers and one
        # process, by its own magnitude: a step of +-lr either way (SGD, which some tests pick, takes no eps)
        *([] if "optim.optimizer=SGD" in extra else ["+optim.override_optimizer_config.eps=1e-4"]),
        "trainer.logger=[file]", "trainer.device=cpu", f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=1", "trainer.save_freq=1", f"trainer.default_local_dir={run_dir}", *extra,
    ]


def resume_from(path):
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={path}"]


def model_weights(step_dir) -> dict[str, torch.Tensor]:
    return CheckpointManager(step_dir.parent).load(step_dir, names=["model"])["model"]


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in COMPARED:
            tolerance = {"rel": GRAD_NORM_RTOL} if key == "train/grad_norm" else {"abs": LOSS_ATOL}
            assert g[key] == pytest.approx(w[key], **tolerance), (g["step"], key)


def assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


# ------------------------------------------------------------------------------------------- runs (slow)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (127.0.0.1) for the module's 2-worker runs; the trainers attach to it."""
    from hyflow.controller.resources import ensure_ray, shutdown_ray

    ensure_ray(num_cpus=2)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, task_dir, tmp_path_factory):
    """The reference: `hyflow sft` on one device (trainer.n_gpus_per_node=1), a checkpoint every step."""
    run = tmp_path_factory.mktemp("sft_one") / "run"
    run_sft(overrides(tiny_model_dir, task_dir, run, "trainer.n_gpus_per_node=1"))
    return run


@pytest.fixture(scope="module")
def two_workers(ray_cluster, tiny_model_dir, task_dir, tmp_path_factory):
    """`hyflow sft trainer.n_gpus_per_node=2` through the CLI: 2 Ray workers (executor auto), gloo, FSDP2."""
    run = tmp_path_factory.mktemp("sft_two") / "run"
    args = overrides(tiny_model_dir, task_dir, run, "trainer.n_gpus_per_node=2")
    assert main(["sft", "--traceback", *args]) == 0
    return run


@pytest.mark.slow
def test_two_ray_workers_train_like_one_process(one_process, two_workers):
    want, got = read_metrics(one_process), read_metrics(two_workers)
    assert_same_rows(got, want)
    assert want[-1]["train/loss"] < want[0]["train/loss"] - 0.1  # it trained: the comparison is not of no-ops
    for step in range(1, STEPS + 1):
        assert_same_weights(model_weights(two_workers / f"global_step_{step}"),
                            model_weights(one_process / f"global_step_{step}"))
    manifest = read_manifest(two_workers / f"global_step_{STEPS}")
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(manifest["components"])


@pytest.mark.slow
def test_sequence_parallel_workers_train_like_one_process(ray_cluster, one_process, tiny_model_dir, task_dir,
                                                          tmp_path):
    """engine.ulysses_sequence_parallel_size=2 on 2 workers (one sequence-parallel group: each runs half of every
    packed row): the losses, gradient norms, validation and weights of one process."""
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, task_dir, run, "trainer.n_gpus_per_node=2",
                     "engine.ulysses_sequence_parallel_size=2")
    assert main(["sft", "--traceback", *args]) == 0
    assert_same_rows(read_metrics(run), read_metrics(one_process))
    for step in range(1, STEPS + 1):
        assert_same_weights(model_weights(run / f"global_step_{step}"), model_weights(one_process / f"global_step_{step}"))


@pytest.mark.slow
def test_a_two_worker_checkpoint_resumes_in_one_process(one_process, two_workers, tiny_model_dir, task_dir,
                                                        tmp_path):
    resumed = run_sft(overrides(tiny_model_dir, task_dir, tmp_path / "run", "trainer.n_gpus_per_node=1",
                                *resume_from(two_workers / "global_step_1")))
    assert_same_rows(resumed, read_metrics(one_process)[1:])
    assert_same_weights(model_weights(tmp_path / "run" / f"global_step_{STEPS}"),
                        model_weights(one_process / f"global_step_{STEPS}"))


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_workers(ray_cluster, one_process, tiny_model_dir, task_dir,
                                                          tmp_path):
    resumed = run_sft(overrides(tiny_model_dir, task_dir, tmp_path / "run", "trainer.n_gpus_per_node=2",
                                *resume_from(one_process / "global_step_2")))
    assert_same_rows(resumed, read_metrics(one_process)[2:])
    assert_same_weights(model_weights(tmp_path / "run" / f"global_step_{STEPS}"),
                        model_weights(one_process / f"global_step_{STEPS}"))


@pytest.mark.slow
def test_hyflow_export_of_a_two_worker_checkpoint_loads_in_transformers(two_workers, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = two_workers / f"global_step_{STEPS}"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--component", "model"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in model_weights(ckpt).items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_lora_sft_on_two_workers_matches_one_process_resumes_and_exports(ray_cluster, tiny_model_dir, task_dir,
                                                                        tmp_path):
    """SFT with model.lora_rank: checkpoints hold the adapter only, 2 FSDP2 workers equal one process, a run
    resumed from step 1 continues identically, and the export is the merged model (or the bare adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # SGD: Adam's first step moves each weight by +-lr whatever its gradient, and a fresh adapter's B factors
    # have gradient entries near 0 whose sign may round differently in another layout.
    lora = ("model.lora_rank=8", "model.lora_alpha=16", "optim.optimizer=SGD", "optim.lr=0.5")
    one = run_sft(overrides(tiny_model_dir, task_dir, tmp_path / "one", "trainer.n_gpus_per_node=1", *lora))
    assert main(["sft", *overrides(tiny_model_dir, task_dir, tmp_path / "two", "trainer.n_gpus_per_node=2",
                                   *lora)]) == 0
    assert_same_rows(read_metrics(tmp_path / "two"), one)
    assert one[-1]["train/loss"] < one[0]["train/loss"] - 0.05  # the adapter trained
    last = f"global_step_{STEPS}"
    adapter = model_weights(tmp_path / "one" / last)
    assert adapter and all(".lora_" in name for name in adapter), sorted(adapter)[:3]
    assert_same_weights(model_weights(tmp_path / "two" / last), adapter)
    resumed = run_sft(overrides(tiny_model_dir, task_dir, tmp_path / "resumed", "trainer.n_gpus_per_node=1", *lora,
                                *resume_from(tmp_path / "one" / "global_step_1")))
    assert_same_rows(resumed, one[1:])
    for flag, out in (([], "merged"), (["--adapter"], "adapter")):
        assert main(["export", "--ckpt", str(tmp_path / "two" / last), "--out", str(tmp_path / out), *flag]) == 0
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        plain = base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(merged, with_adapter, atol=1e-5, rtol=0)
    assert float((merged - plain).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------- config errors


def test_a_batch_that_does_not_split_over_the_devices_is_an_error():
    with pytest.raises(ConfigError, match=r"data.train_batch_size=10 samples cannot be split evenly over "
                                          r"trainer.nnodes=1 x trainer.n_gpus_per_node=4 = 4 device\(s\).*Set "
                                          r"data.train_batch_size to a multiple of 4 \(e.g. 8 or 12\)"):
        load_sft_config(["trainer.n_gpus_per_node=4", "data.train_batch_size=10", "data.micro_batch_size_per_gpu=1"])


def test_a_device_share_that_is_no_whole_number_of_micro_batches_is_an_error():
    with pytest.raises(ConfigError, match=r"data.train_batch_size=12 samples is not a multiple of data.micro_batch_"
                                          r"size_per_gpu=4 x 2 device\(s\) = 8.*\(e.g. 8 or 16\) or pick a "
                                          r"micro_batch_size_per_gpu that divides data.train_batch_size / 2 = 6"):
        load_sft_config(["trainer.nnodes=2", "data.train_batch_size=12", "data.micro_batch_size_per_gpu=4"])
    # a token budget instead of a micro-batch size: only the split over the devices must be even
    load_sft_config(["trainer.nnodes=2", "data.train_batch_size=12", "data.micro_batch_size_per_gpu=4",
                     "data.use_dynamic_bsz=true"])


def test_a_token_budget_below_the_longest_sample_is_an_error():
    with pytest.raises(ConfigError, match=r"data.max_token_len_per_gpu=512 tokens is less than data.max_length=1024"
                                          r".*Raise data.max_token_len_per_gpu to at least 1024"):
        load_sft_config(["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=512"])


def test_the_local_executor_on_several_devices_is_an_error():
    with pytest.raises(ConfigError, match=r"trainer.executor=local runs one worker in this process, but "
                                          r"trainer.nnodes=1 x trainer.n_gpus_per_node=2 = 2 device\(s\); use "
                                          r"trainer.executor=ray"):
        load_sft_config(["trainer.executor=local", "trainer.n_gpus_per_node=2", "data.train_batch_size=8"])


def test_a_model_object_on_several_devices_is_an_error(tiny_model_dir, task_dir, tmp_path):
    from hyflow.models.loading import load_causal_lm

    args = overrides(tiny_model_dir, task_dir, tmp_path / "run", "trainer.n_gpus_per_node=2")
    with pytest.raises(ConfigError, match=r"SFTTrainer\(model=...\) trains that object in this process.*"
                                          r"2 device\(s\) on trainer.executor=ray.*set model.partial_pretrain=DIR"):
        SFTTrainer(args, model=load_causal_lm(tiny_model_dir))
