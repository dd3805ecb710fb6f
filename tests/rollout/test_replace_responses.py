"""`replace_responses` (SPIN's reference answers in the place of samples) builds the rows `assemble_rollout` would."""

import torch

from hyflow.batch import Batch
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.output import assemble_rollout, replace_responses


def rollout(responses, lengths):
    prompts = Batch({"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
                     "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})
    params = SamplingParams(n=2, max_new_tokens=4, calculate_log_probs=True)
    return assemble_rollout(prompts, prompts["input_ids"], prompts["attention_mask"], responses,
                            torch.full(responses.shape, -0.5), lengths, params)


def test_a_replaced_row_is_the_row_assembled_from_its_tokens():
    sampled = torch.tensor([[11, 12, 13, 2], [14, 2, 0, 0], [15, 16, 2, 0], [17, 18, 19, 20]])
    batch = rollout(sampled, torch.tensor([4, 2, 3, 4]))
    out = replace_responses(batch, [1, 3], [[21, 22, 23, 2], [24, 2, 30, 31, 32]], pad_token_id=0)
    expected = rollout(torch.tensor([[11, 12, 13, 2], [21, 22, 23, 2], [15, 16, 2, 0], [24, 2, 30, 31]]),
                       torch.tensor([4, 4, 3, 4]))
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", "prompts"):
        assert torch.equal(out[key], expected[key]), key
    assert torch.equal(out["rollout_log_probs"][[0, 2]], batch["rollout_log_probs"][[0, 2]])
    assert float(out["rollout_log_probs"][[1, 3]].abs().sum()) == 0
    assert torch.equal(batch["responses"], sampled)  # the input is left as it was
