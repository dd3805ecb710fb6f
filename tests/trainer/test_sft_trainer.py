"""SFT trainer: it learns, gradients are micro-batch invariant (the reference functions and the worker's engine
path agree), resume is exact, checkpoints export, and config errors name the fix. Several workers:
test_sft_distributed.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from hyflow.algos import loss_normalisers
from hyflow.config.keys import ConfigError
from hyflow.config.sft_schema import SFTConfig, load_sft_config
from hyflow.data.sft_dataset import SFTDataset
from hyflow.data.tasks import make_task
from hyflow.models.loading import load_causal_lm
from hyflow.trainer.sft_trainer import SFTTrainer, accumulate_sft_gradients, run_sft, sft_spec, token_nll_sum
from hyflow.trainer.tracking import read_metrics
from hyflow.workers.engine import all_reduce_sum
from hyflow.workers.sft import SFTWorker, as_engine_batch, sft_loss


@pytest.fixture(scope="module")
def task_paths(tmp_path_factory):
    return make_task("arithmetic", tmp_path_factory.mktemp("sft_data"), n_train=32, n_test=8, seed=0)


def overrides(model_dir, paths, run_dir, *extra):
    return [
        f"model.partial_pretrain={model_dir}",
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['test']}",
        "data.response_key=extra_info.answer",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=4",
        "model.enable_gradient_checkpointing=false",
        "optim.lr=3e-3",
        "trainer.logger=[file]",
        "trainer.device=cpu",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


# ------------------------------------------------------------------------------------------- loss


def test_token_nll_sum_is_shifted_cross_entropy_on_masked_tokens(tiny_model_dir, tiny_tokenizer, task_paths):
    ds = SFTDataset(task_paths["train"], tiny_tokenizer, response_key="extra_info.answer")
    batch = ds.collate([ds[0], ds[1], ds[2]])
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll_BT = torch.nn.functional.cross_entropy(
            logits_BTV[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
        expected = (nll_BT * batch["loss_mask"][:, 1:]).sum()
        got = token_nll_sum(model, batch)
    assert batch["loss_mask"][:, 0].sum() == 0 and batch["loss_mask"].sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_gradient_accumulation_equals_full_batch_gradient(tiny_model_dir, tiny_tokenizer, task_paths):
    ds = SFTDataset(task_paths["train"], tiny_tokenizer, response_key="extra_info.answer")
    batch = ds.collate([ds[i] for i in range(5)])
    model = load_causal_lm(tiny_model_dir)

    def grads(parts):
        model.zero_grad(set_to_none=True)
        loss = accumulate_sft_gradients(model, parts, torch.device("cpu"))
        return loss, torch.cat([p.grad.flatten() for p in model.parameters()])

    full_loss, full_grad = grads([batch])
    tokens = batch["loss_mask"][:, 1:].sum(-1)
    assert len(set(tokens.tolist())) > 1  # uneven trained-token counts, so a mean of means would differ
    for parts in ([batch[0:1], batch[1:5]], [batch[0:3], batch[3:5]], batch.split(1)):
        loss, grad = grads(parts)
        assert loss == pytest.approx(full_loss, abs=1e-6)
        torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-6)


def sft_worker(model_dir, paths, run_dir, *extra) -> SFTWorker:
    """A one-process SFT worker with its engine built, as the trainer's local executor makes it."""
    trainer = SFTTrainer(overrides(model_dir, paths, run_dir, *extra))
    worker = SFTWorker(sft_spec(trainer.config, trainer.batches, total_steps=1))
    worker.init_model()
    return worker


@pytest.mark.parametrize("sizing", [("data.micro_batch_size_per_gpu=1",), ("data.micro_batch_size_per_gpu=5",),
                                    ("data.use_dynamic_bsz=true", "data.max_length=64",
                                     "data.max_token_len_per_gpu=70")])
def test_the_workers_engine_path_equals_the_reference_loss_and_gradient(tiny_model_dir, tiny_tokenizer, task_paths,
                                                                        tmp_path, sizing):
    ds = SFTDataset(task_paths["train"], tiny_tokenizer, response_key="extra_info.answer")
    batch = ds.collate([ds[i] for i in range(5)])
    reference = load_causal_lm(tiny_model_dir)
    want_loss = accumulate_sft_gradients(reference, [batch], torch.device("cpu"))
    want = {name: p.grad for name, p in reference.named_parameters()}

    worker = sft_worker(tiny_model_dir, task_paths, tmp_path, "data.train_batch_size=5", *sizing)
    data = as_engine_batch(batch)
    norms = all_reduce_sum(loss_normalisers(data["response_mask"], "token-mean"))
    parts = worker.engine.forward_backward(data, worker.spec.batches, sft_loss, columns=("response_mask",), norms=norms)
    assert parts["train/loss"] == pytest.approx(want_loss, abs=1e-6)
    for name, param in worker.engine.model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=0, atol=1e-6, msg=name)
    nll = worker.validate(batch)
    assert nll["tokens"] == batch["loss_mask"][:, 1:].sum()
    assert nll["nll"] / nll["tokens"] == pytest.approx(want_loss, abs=1e-6)


# ------------------------------------------------------------------------------------------- training


def test_loss_goes_down_and_metrics_are_logged(tiny_model_dir, task_paths, tmp_path):
    run = tmp_path / "run"
    history = SFTTrainer(overrides(tiny_model_dir, task_paths, run, "trainer.total_training_steps=20",
                                   "trainer.test_freq=10", "optim.lr_scheduler=constant")).fit()
    assert [r["step"] for r in history] == list(range(1, 21))
    first, last = history[0]["train/loss"], sum(r["train/loss"] for r in history[-3:]) / 3
    assert last < 0.6 * first
    assert [r["step"] for r in history if "val/loss" in r] == [10, 20]
    assert history[-1]["val/loss"] < history[9]["val/loss"]
    assert {"train/loss", "train/lr", "train/grad_norm"} <= set(history[0])
    assert read_metrics(run) == history
    assert (run / "config.yaml").is_file() and (run / "global_step_20" / "manifest.json").is_file()


def test_warmup_then_cosine_learning_rate(tiny_model_dir, task_paths, tmp_path):
    history = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "run", "trainer.total_training_steps=8",
                                   "optim.lr_warmup_steps=2", "optim.lr=1e-3")).fit()
    lrs = [r["train/lr"] for r in history]
    assert lrs[:3] == pytest.approx([0.5e-3, 1e-3, 1e-3])  # linear warm-up, then cosine from the peak
    assert all(a > b for a, b in itertools.pairwise(lrs[2:]))


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tiny_model_dir, task_paths, tmp_path):
    extra = ("trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=2")
    SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "a", *extra)).fit()

    crashing = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "b", *extra))
    train_step = crashing.train_step

    def crash_at_step_4(batch):
        if crashing.step == 4:
            raise KeyboardInterrupt
        return train_step(batch)

    crashing.train_step = crash_at_step_4
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3]

    resumed = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "b", *extra))
    history = resumed.fit()
    assert [r["step"] for r in history] == [4, 5, 6]
    assert read_metrics(tmp_path / "b") == read_metrics(tmp_path / "a")


def test_offloaded_sft_trains_like_a_plain_one_and_stays_on_the_host(tiny_model_dir, task_paths, tmp_path,
                                                                     monkeypatch):
    """engine.param_offload / optimizer_offload: the model and the optimizer state move in for each step (and the
    model for validation) and back after; every move copies into new storage (TrainEngine.offload_copies, as a
    host <-> accelerator move does), yet the run's numbers are the plain run's."""
    from hyflow.workers.train_engine import TrainEngine

    extra = ("trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.test_freq=2")
    plain = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "plain", *extra)).fit()
    monkeypatch.setattr(TrainEngine, "offload_copies", True)
    engines = []
    init = TrainEngine.__init__
    monkeypatch.setattr(TrainEngine, "__init__", lambda self, *a, **k: (engines.append(self), init(self, *a, **k))[1])
    trainer = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "off", *extra, "engine.param_offload=true",
                                   "engine.optimizer_offload=true"))
    offloaded = trainer.fit()
    assert [r["step"] for r in offloaded] == [r["step"] for r in plain]
    for got, want in zip(offloaded, plain):
        for key in ("train/loss", "train/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    (engine,) = engines
    assert engine.location() == {"params": "host", "optimizer": "host"}
    # each of the 3 steps loads both parts, validation (steps 2 and 3) the parameters, the last step's checkpoint
    # both; every load is followed by an offload
    counts = engine.offload_counts
    assert counts["optimizer_to_device"] >= 3 and counts["params_to_device"] >= 5
    assert counts["optimizer_to_device"] == counts["optimizer_to_host"] - 1  # the first move: offloaded at start
    assert counts["params_to_device"] == counts["params_to_host"] - 1


def test_checkpoint_exports_to_a_transformers_model(tiny_model_dir, tiny_tokenizer, task_paths, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyflow.trainer.export import export_checkpoint

    model = load_causal_lm(tiny_model_dir)  # objects passed in: trained in place by the in-process worker
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path / "run", "trainer.total_training_steps=2"),
                         model=model, tokenizer=tiny_tokenizer)
    trainer.fit()
    out = export_checkpoint(tmp_path / "run" / "global_step_2", tmp_path / "hf", component="model")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(model.state_dict()["model.norm.weight"], before["model.norm.weight"])
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("1 + 2")["input_ids"] == tiny_tokenizer("1 + 2")["input_ids"]


def test_run_sft_trains_from_overrides(tiny_model_dir, task_paths, tmp_path):
    history = run_sft(overrides(tiny_model_dir, task_paths, tmp_path / "run", "trainer.total_training_steps=1"))
    assert len(history) == 1 and "val/loss" in history[0]


# ------------------------------------------------------------------------------------------- config


def test_defaults_follow_verl_and_resolve_the_run_directory():
    cfg = SFTConfig()
    assert cfg.trainer.default_local_dir == "checkpoints/hyflow-sft/default"
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.lr_scheduler) == (1e-5, [0.9, 0.95], "cosine")
    assert load_sft_config(["trainer.experiment_name=x"]).trainer.default_local_dir == "checkpoints/hyflow-sft/x"


@pytest.mark.parametrize(("key", "suggestion"), [
    ("data.micro_batch_size_per_gpuu", "data.micro_batch_size_per_gpu"),
    ("optim.lr_schedule", "optim.lr_scheduler"),
    ("trainr.total_epochs", "trainer.total_epochs"),
    ("model.partial_pretrian", "model.partial_pretrain"),
])
def test_unknown_key_names_the_closest_sft_key(key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'. Did you mean '{suggestion}'"):
        load_sft_config([f"{key}=1"])


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate' in config file"):
        load_sft_config([], config_file=path)


def test_batch_size_that_does_not_divide_is_a_clear_error(tiny_model_dir, task_paths, tmp_path):
    bad = overrides(tiny_model_dir, task_paths, tmp_path, "data.train_batch_size=10")
    with pytest.raises(ConfigError, match=r"data.train_batch_size=10 samples is not a multiple of "
                                          r"data.micro_batch_size_per_gpu=4 .* \(e.g. 8 or 12\)"):
        SFTTrainer(bad)


def test_bad_choice_and_missing_model_are_errors(task_paths, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr_scheduler='wsd' is not one of: constant, cosine"):
        load_sft_config(["optim.lr_scheduler=wsd"])
    with pytest.raises(ConfigError, match="model.partial_pretrain is not set"):
        SFTTrainer([f"data.train_files={task_paths['train']}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_an_error(tiny_model_dir, task_paths, tmp_path):
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device"):
        SFTTrainer(overrides(tiny_model_dir, task_paths, tmp_path, "trainer.device=cuda"))
