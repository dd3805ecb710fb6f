"""Issue acceptance: data from the CLI -> RL dataset -> hf rollout (8 prompts x 4 samples) -> arithmetic scorer,
and the rollout's log-probs agree with the trainer's recomputation to 1e-5."""

import torch
from transformers import AutoModelForCausalLM

from hyflow.cli import main as cli_main
from hyflow.data.rl_dataset import PromptLoader, RLDataset
from hyflow.models.forward import response_logprobs
from hyflow.rewards.managers import make_reward_manager
from hyflow.rollout.base import SamplingParams, make_engine


def test_cli_data_generate_score_and_logprob_agreement(tmp_path, tiny_model_dir, tiny_tokenizer, capsys):
    assert cli_main(["data", "make", "arithmetic", "--out", str(tmp_path), "--n-train", "64", "--n-test", "16"]) == 0
    assert "train" in capsys.readouterr().out
    dataset = RLDataset(tmp_path / "train.parquet", tiny_tokenizer, max_prompt_length=64)
    prompts = PromptLoader(dataset, 8, seed=0).next_batch()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = make_engine("hf", model=model, eos_token_id=tiny_tokenizer.eos_token_id,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=0))

    R = 24
    assert len(out) == 32 and out["responses"].shape == (32, R)
    assert list(out["ground_truth"][:4]) == [prompts["ground_truth"][0]] * 4
    mask = out["response_mask"]
    lengths = mask.sum(-1)
    eos = tiny_tokenizer.eos_token_id
    for row in range(32):
        L = int(lengths[row])
        assert mask[row, :L].all() and not mask[row, L:].any()
        tokens = out["responses"][row].tolist()
        assert eos not in tokens[: L - 1]  # the mask ends at the first EOS ...
        if L < R:
            assert tokens[L - 1] == eos  # ... which is included

    result = make_reward_manager("naive", tiny_tokenizer, num_workers=0)(out)
    assert result.token_level_scores.shape == (32, R)
    assert set(result.scores) <= {0.0, 1.0} and result.metrics["reward/errors"] == 0
    assert "acc" in result.extra

    with torch.no_grad():
        recomputed, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                                          temperature=1.0)
    diff = ((recomputed - out["rollout_log_probs"]).abs() * mask).max().item()
    print(f"max |rollout - recomputed| log-prob difference: {diff:.2e}")
    assert diff < 1e-5
