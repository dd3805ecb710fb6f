"""Preference training (`hyflow dpo`): it learns (the chosen answers' implicit reward overtakes the rejected ones'),
every loss type trains and logs TRL's metrics, the gradient does not depend on the micro-batch size, LoRA's reference
is the base model, resume is exact, checkpoints export, 2 Ray workers (gloo, FSDP2) train as one process does, and
config and data errors name the key or column and the fix."""

from __future__ import annotations

import json

import pytest
import torch

from hyflow.cli import main
from hyflow.config.dpo_schema import load_dpo_config
from hyflow.config.keys import ConfigError
from hyflow.data.preference_dataset import PreferenceDataset
from hyflow.data.rl_dataset import DataError
from hyflow.data.tasks import make_task
from hyflow.trainer.dpo_trainer import DPOTrainer, run_dpo
from hyflow.trainer.tracking import read_metrics

TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The built-in arithmetic task with TRL's preference columns: chosen = the worked answer, rejected = the same
    work ending in a wrong value; 32 training and 8 held-out pairs of one-digit sums and differences."""
    return make_task("arithmetic", tmp_path_factory.mktemp("dpo_data"), n_train=32, n_test=8, seed=0, digits=1,
                     preference_pairs=True)


def overrides(model_dir, paths, run_dir, *extra):
    return [
        f"model.partial_pretrain={model_dir}", f"data.train_files={paths['train']}",
        f"data.val_files={paths['test']}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
        "data.max_length=64", "model.enable_gradient_checkpointing=false", "optim.lr=3e-3",
        "trainer.logger=[file]", "trainer.device=cpu", f"trainer.default_local_dir={run_dir}", *extra,
    ]


# ------------------------------------------------------------------------------------------- it learns


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_dpo_makes_the_chosen_answers_more_likely(tiny_model_dir, pairs, tmp_path, seed):
    """30 steps of sigmoid DPO (beta 0.5) on 32 pairs: at step 1 the policy is the reference (rewards 0, no pair
    ranked right); over the last 5 steps at least 85 % of each step's pairs rank the chosen answer above the
    rejected one and the mean reward margin is above 1 (measured, seeds 1 and 2: 0.95-1.0 and 2.6-4.3)."""
    history = DPOTrainer(overrides(
        tiny_model_dir, pairs, tmp_path / "run", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
        "data.val_files=null", "algorithm.beta=0.5", "optim.lr_scheduler=constant", "trainer.total_training_steps=30",
        "trainer.save_freq=0", f"trainer.seed={seed}")).fit()
    first, last = history[0], history[-5:]
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    assert first["train/loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # -log sigma(0)
    assert sum(r["rewards/accuracies"] for r in last) / 5 >= 0.85
    assert sum(r["rewards/margins"] for r in last) / 5 > 1.0
    assert sum(r["train/loss"] for r in last) / 5 < 0.45
    gap = [r["logps/chosen"] - r["logps/rejected"] for r in history]
    assert sum(gap[-5:]) / 5 > sum(gap[:5]) / 5 + 1.0  # the chosen answers' log-probs pulled ahead


# ------------------------------------------------------------------------------------------- every loss


@pytest.mark.parametrize(("loss_type", "extra"), [
    ("sigmoid", ("algorithm.label_smoothing=0.1",)), ("ipo", ()), ("hinge", ()), ("robust", ()),
    ("cpo", ("algorithm.cpo_alpha=0.5",)), ("simpo", ("algorithm.simpo_gamma=0.3", "algorithm.beta=2.0")),
    ("orpo", ()), ("kto", ("algorithm.undesirable_weight=1.5",)),
])
def test_every_loss_type_trains_and_logs_trls_metrics(tiny_model_dir, pairs, tmp_path, loss_type, extra):
    if loss_type == "kto":  # unpaired rows: each pair's chosen (label true) and rejected (false) as two rows
        rows = [r for p in _rows(pairs["train"]) for r in (
            {"prompt": p["prompt"], "completion": p["chosen"], "label": True},
            {"prompt": p["prompt"], "completion": p["rejected"], "label": False})]
        data = tmp_path / "kto.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra = (*extra, f"data.train_files={data}", "data.val_files=null")
    history = run_dpo(overrides(tiny_model_dir, pairs, tmp_path / "run", f"algorithm.loss_type={loss_type}", *extra,
                                "trainer.total_training_steps=2", "trainer.save_freq=0"))
    assert [r["step"] for r in history] == [1, 2]
    names = set(history[-1])
    assert {"train/loss", "train/lr", "train/grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"} <= names
    if loss_type != "kto":
        assert set(TRL_METRICS) <= names and {f"val/{m}" for m in TRL_METRICS} | {"val/loss"} <= names
    extra_names = {"cpo": {"nll_loss"}, "simpo": {"nll_loss"}, "orpo": {"nll_loss", "log_odds_ratio",
                                                                          "log_odds_chosen"}, "kto": {"kl"}}
    assert extra_names.get(loss_type, set()) <= names
    if loss_type in ("sigmoid", "ipo", "hinge", "robust", "kto"):  # the policy starts as the reference
        assert history[0]["rewards/chosen"] == 0.0 and history[0]["rewards/rejected"] == 0.0
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in history)
    assert history[0]["train/grad_norm"] > 0


def _rows(path):
    from hyflow.data.io import read_rows

    return read_rows(path)


def test_micro_batch_size_does_not_change_the_step(tiny_model_dir, pairs, tmp_path):
    """CPO (its NLL term is a token mean over the step's chosen completions) with 1 pair per micro-batch and with all
    8 at once: the same losses, gradient norms and metrics (float32 summation order apart)."""
    runs = [run_dpo(overrides(tiny_model_dir, pairs, tmp_path / f"m{m}", "algorithm.loss_type=cpo",
                              f"data.micro_batch_size_per_gpu={m}", "model.use_remove_padding=false",
                              "trainer.total_training_steps=3", "trainer.save_freq=0"))
            for m in (1, 8)]
    assert {"nll_loss", "val/loss", "val/nll_loss"} <= set(runs[0][-1])
    for a, b in zip(*runs, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_lora_reference_is_the_base_model(tiny_model_dir, pairs, tmp_path):
    """With LoRA no second model is loaded: the reference is the same model with the adapter off, so at step 1
    (adapter B = 0) the rewards are exactly 0, and the adapter trains."""
    trainer = DPOTrainer(overrides(tiny_model_dir, pairs, tmp_path / "run", "model.lora_rank=8", "model.lora_alpha=16",
                                   "trainer.total_training_steps=3", "trainer.save_freq=0"))
    history = trainer.fit()
    assert history[0]["rewards/chosen"] == 0.0 and history[0]["rewards/margins"] == 0.0
    assert history[-1]["rewards/chosen"] != 0.0
    assert "LoRA adapter off" in trainer.describe()


def test_the_reference_stays_the_initial_policy(tiny_model_dir, pairs, tmp_path):
    """Sigmoid DPO, validated before the first step (policy = reference: rewards 0, loss log 2) and after each of 2
    steps. A sequence's reward is beta (log pi - log pi_ref), so val/logps - val/rewards / beta is the reference's
    mean log-prob of the validation rows: after each step it still equals the initial policy's, while the policy's
    own has moved (a reference that follows the policy gives rewards 0 and the current policy's log-probs)."""
    beta = 0.5
    trainer = DPOTrainer(overrides(tiny_model_dir, pairs, tmp_path / "run", f"algorithm.beta={beta}",
                                   "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.save_freq=0"))
    train_step, initial = trainer.train_step, {}

    def validate_first(batch):
        if not initial:
            initial.update(trainer.validate())
        return train_step(batch)

    trainer.train_step = validate_first
    history = trainer.fit()
    log2 = 0.6931471805599453  # -log sigma(0)
    assert initial["val/rewards/chosen"] == initial["val/rewards/rejected"] == 0.0
    assert initial["val/loss"] == pytest.approx(log2, abs=1e-6)
    assert history[0]["train/loss"] == pytest.approx(log2, abs=1e-6)
    assert [r["step"] for r in history] == [1, 2]
    for row in history:
        for side in ("chosen", "rejected"):
            reference = row[f"val/logps/{side}"] - row[f"val/rewards/{side}"] / beta
            assert reference == pytest.approx(initial[f"val/logps/{side}"], rel=1e-5, abs=1e-4), (row["step"], side)
            assert abs(row[f"val/logps/{side}"] - initial[f"val/logps/{side}"]) > 1e-3, (row["step"], side)
    assert history[-1]["val/rewards/margins"] != 0.0 and history[-1]["rewards/chosen"] != 0.0


# ------------------------------------------------------------------------------------------- resume, export


@pytest.mark.parametrize("loss_type", ["sigmoid", "kto"])
def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tiny_model_dir, pairs, tmp_path, loss_type):
    extra = ("trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=2")
    if loss_type == "kto":
        rows = [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"} for p in _rows(pairs["train"])
                for k in ("chosen", "rejected")]
        data = tmp_path / "kto.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra = (*extra, "algorithm.loss_type=kto", f"data.train_files={data}", "data.val_files=null")
    DPOTrainer(overrides(tiny_model_dir, pairs, tmp_path / "a", *extra)).fit()
    crashing = DPOTrainer(overrides(tiny_model_dir, pairs, tmp_path / "b", *extra))
    train_step = crashing.train_step

    def crash_at_step_4(batch):
        if crashing.step == 4:
            raise KeyboardInterrupt
        return train_step(batch)

    crashing.train_step = crash_at_step_4
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3]
    history = DPOTrainer(overrides(tiny_model_dir, pairs, tmp_path / "b", *extra)).fit()
    assert [r["step"] for r in history] == [4, 5, 6]
    assert read_metrics(tmp_path / "b") == read_metrics(tmp_path / "a")


def test_checkpoint_exports_to_a_transformers_model(tiny_model_dir, pairs, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dpo(overrides(tiny_model_dir, pairs, tmp_path / "run", "trainer.total_training_steps=1"))
    assert main(["export", "--ckpt", str(tmp_path / "run" / "global_step_1"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [not torch.equal(a, b) for a, b in zip(exported.parameters(), original.parameters(), strict=True)]
    assert any(moved)


# ------------------------------------------------------------------------------------------- 2 workers


@pytest.mark.slow
def test_two_ray_workers_train_like_one_process(tiny_model_dir, pairs, tmp_path, monkeypatch):
    """`hyflow dpo trainer.n_gpus_per_node=2`: 2 Ray workers on 127.0.0.1 (gloo, FSDP2, each with its own frozen
    reference shard) log the rows one process logs. Tolerances as tests/trainer/test_sft_distributed.py measured
    them for the same model: float32 summation order only."""
    from hyflow.controller.resources import ensure_ray, shutdown_ray

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    extra = ("trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.save_freq=0",
             "+optim.override_optimizer_config.eps=1e-4", "data.val_max_samples=7")  # 7 pairs: padded for 2
    one = run_dpo(overrides(tiny_model_dir, pairs, tmp_path / "one", *extra))
    ensure_ray(num_cpus=2)
    try:
        assert main(["dpo", "--traceback", *overrides(tiny_model_dir, pairs, tmp_path / "two", *extra,
                                                      "trainer.n_gpus_per_node=2")]) == 0
    finally:
        shutdown_ray()
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3] and set(two[-1]) == set(one[-1])
    for a, b in zip(one, two, strict=True):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-5), (a["step"], key)
    assert one[-1]["rewards/margins"] != 0.0  # it trained: the comparison is not of no-ops


# ------------------------------------------------------------------------------------------- errors


def test_a_missing_column_is_named_with_the_fix(tiny_tokenizer):
    with pytest.raises(DataError, match=r"row 0: missing column 'rejected'.*set data.rejected_key=<your column"):
        PreferenceDataset([{"prompt": "q", "chosen": "a", "worse": "b"}], tiny_tokenizer)
    with pytest.raises(DataError, match=r"missing column 'label'.*KTO row needs prompt, completion and label"):
        PreferenceDataset([{"prompt": "q", "completion": "a"}], tiny_tokenizer, paired=False)
    with pytest.raises(DataError, match=r"missing column 'prompt'.*string completions need a prompt column"):
        PreferenceDataset([{"chosen": "a", "rejected": "b"}], tiny_tokenizer)


def test_the_prompt_of_whole_conversations_is_their_common_prefix(tiny_tokenizer):
    """TRL's implicit prompt: chosen and rejected as whole conversations; only the last turn is trained on."""
    user = {"role": "user", "content": "Say hi"}
    ds = PreferenceDataset([{"chosen": [user, {"role": "assistant", "content": "hi"}],
                             "rejected": [user, {"role": "assistant", "content": "no"}]}], tiny_tokenizer)
    batch = ds.collate([ds[0]])
    trained = [tiny_tokenizer.decode(batch["input_ids"][i][batch["loss_mask"][i].bool()]) for i in (0, 1)]
    assert trained == ["hi<|im_end|>", "no<|im_end|>"]


@pytest.mark.parametrize(("args", "message"), [
    (["algorithm.loss_type=dpo"], r"algorithm.loss_type='dpo' is not one of: sigmoid, ipo, hinge, robust, cpo, "
                                  r"simpo, orpo, kto"),
    (["algorithm.cpo_alpha=1"], r"algorithm.cpo_alpha=1.0 is not read by algorithm.loss_type=sigmoid"),
    (["algorithm.loss_type=kto", "algorithm.simpo_gamma=0.5"], r"algorithm.simpo_gamma=0.5 is not read by "
                                                              r"algorithm.loss_type=kto"),
    (["algorithm.label_smoothing=0.5"], r"label_smoothing=0.5 must be in \[0, 0.5\)"),
    (["data.train_batch_size=6", "data.micro_batch_size_per_gpu=4"], r"data.train_batch_size=6 pairs is not a "
                                                                     r"multiple of data.micro_batch_size_per_gpu=4"),
    (["engine.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"], r"would split pairs"),
])
def test_config_errors_name_the_key_and_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        load_dpo_config(args)


def test_the_config_and_the_losses_agree_on_each_losss_knobs():
    from hyflow.algos.preference import PREFERENCE_LOSSES
    from hyflow.config.dpo_schema import LOSS_KNOBS

    assert {name: PREFERENCE_LOSSES.get(name).knobs for name in PREFERENCE_LOSSES.names()} == LOSS_KNOBS


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match=r"unknown config key 'data.chosen'. Did you mean 'data.chosen_key'"):
        load_dpo_config(["data.chosen=x"])
    with pytest.raises(ConfigError, match=r"algorithm.gamma"):
        load_dpo_config(["algorithm.gamma=0.5"])


def test_cli_reports_an_unknown_loss_type(capsys):
    assert main(["dpo", "algorithm.loss_type=simpoo"]) == 2
    assert "Did you mean 'simpo'" in capsys.readouterr().err
