"""PRIME's implicit PRM learns the outcome (hyflow.workers.prm): trained on rows whose outcome is decided by the
response's first token, its implicit reward sum_t q_t ranks held-out correct responses above incorrect ones, and
verl's `reward_model/dpo_acc` on them (computed as the trainer computes it, `prime_process_rewards`) rises above the
untrained PRM's. A PRM trained toward the inverted outcome, or one that does not learn, fails both."""

from __future__ import annotations

import numpy as np
import torch

from hyflow.algos.prime import prime_process_rewards
from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.config.roles import prm_spec
from hyflow.controller import LocalWorkerGroup
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.workers.prm import ImplicitPRMWorker

P, R = 6, 8  # prompt and response widths
PROMPTS, N = 8, 4  # prompts per batch, samples per prompt (2 correct, 2 incorrect, in random order)
GOOD, BAD = torch.arange(100, 110), torch.arange(110, 120)  # first response token of a correct / incorrect sample
NEUTRAL = (130, 300)  # the other response tokens: the same distribution for both outcomes
UPDATES = 6  # update_prm calls, 2 optimizer steps each (32 samples, mini-batches of 16)


def outcome_rows(seed: int) -> tuple[Batch, torch.Tensor, np.ndarray]:
    """PROMPTS x N samples (left-aligned prompts, right-padded responses of 3..R tokens) with the PRM update's
    columns; returns (batch, acc [B], uid [B])."""
    g = torch.Generator().manual_seed(seed)
    B = PROMPTS * N
    prompts = torch.randint(5, 300, (PROMPTS, P), generator=g).repeat_interleave(N, 0)
    acc = torch.cat([torch.tensor([1.0, 1.0, 0.0, 0.0])[torch.randperm(N, generator=g)] for _ in range(PROMPTS)])
    first = torch.where(acc.bool(), GOOD[torch.randint(0, len(GOOD), (B,), generator=g)],
                        BAD[torch.randint(0, len(BAD), (B,), generator=g)])
    responses = torch.randint(*NEUTRAL, (B, R), generator=g)
    responses[:, 0] = first
    response_mask = (torch.arange(R) < torch.randint(3, R + 1, (B, 1), generator=g)).long()
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1)
    batch = Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                   "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                   "response_mask": response_mask,
                   "prm_acc": acc[:, None].expand(B, R).contiguous(),
                   "prm_row": torch.arange(B, dtype=torch.float32)[:, None].expand(B, R).contiguous()})
    return batch, acc, np.array([f"{seed}-{i // N}" for i in range(B)], dtype=object)


def test_the_implicit_prm_learns_to_rank_correct_responses_above_incorrect_ones(tiny_model_dir):
    cfg = load_config(["trainer.device=cpu", f"actor_rollout_ref.model.path={tiny_model_dir}",
                       "algorithm.adv_estimator=prime", "reward_model.enable=true", "reward_model.model.optim.lr=3e-3",
                       "reward_model.mini_batch_size=16", f"data.train_batch_size={PROMPTS}",
                       f"actor_rollout_ref.rollout.n={N}", "trainer.seed=0"])
    spec = prm_spec(cfg)
    prm = LocalWorkerGroup(ImplicitPRMWorker, spec)
    prm.init_model()
    held_out, acc, uid = outcome_rows(10_000)
    held_out.union(prm.compute_prm_ref_log_probs(held_out))

    def scored() -> tuple[float, float]:
        """(share of (correct, incorrect) held-out pairs whose summed q is strictly higher for the correct one,
        the trainer's reward_model/dpo_acc of the held-out rows)."""
        q = prm.compute_prm_q(held_out.clone())["prm_q"]
        _, metrics = prime_process_rewards(q, acc, held_out["response_mask"], uid, beta=spec.beta,
                                           granularity="token", norm="batch_norm")
        total = (q * held_out["response_mask"]).sum(-1)
        ranked = (total[acc == 1][:, None] > total[acc == 0][None, :]).float().mean()
        return float(ranked), metrics["reward_model/dpo_acc"]

    untrained = scored()  # q = 0: the PRM starts as its reference, so every pair ties
    for step in range(UPDATES):
        batch, _, _ = outcome_rows(step)
        batch.union(prm.compute_prm_ref_log_probs(batch))
        batch.meta["global_step"] = step + 1
        prm.update_prm(with_mini_batch_rows(batch, 16))
    ranked, dpo_acc = scored()
    # Measured (seeds 0, 1, 2 of the rows and trainer.seed; lr 3e-3): ranked 0.99 / 0.78 / 0.99, dpo_acc 1.0 / 0.78 /
    # 0.97 against the untrained PRM's 0.56 / 0.31 / 0.56 (all ties: its dpo_acc is an artefact of the row order);
    # lr 1e-2 gave 0.96 / 0.80 / 1.0. The bounds sit below the worst seed by ~0.08 (ranked, dpo_acc) and below the
    # least rise (0.41) by half. A PRM trained toward the inverted outcome ranks them the other way.
    assert untrained[0] == 0.0
    assert ranked >= 0.7, (ranked, untrained)
    assert dpo_acc >= 0.7 and dpo_acc >= untrained[1] + 0.2, (dpo_acc, untrained)
