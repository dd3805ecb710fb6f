"""One engine pass for the parallel-equivalence tests (tests/parallel): a batch of packed-looking rows, a loss
without clipping (-A log p, token-mean: no token can sit on a clip boundary) and infer + one update of a
`TrainEngine` on it."""

from __future__ import annotations

import torch

from hyflow.algos import agg_loss
from hyflow.batch import Batch

PROMPT, RESPONSE = 7, 5


def rows_batch(vocab: int, rows: int = 8) -> Batch:
    """`rows` rows: left-padded prompts of 4-7 tokens, right-padded responses of 2-5, an advantage per token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (rows, PROMPT + RESPONSE), generator=g)
    mask = torch.zeros_like(ids)
    for b in range(rows):
        mask[b, PROMPT - (4 + b % 4):PROMPT + 2 + (b * 3) % 4] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids,
                  "responses": (ids * mask)[:, PROMPT:], "response_mask": mask[:, PROMPT:],
                  "advantages": torch.randn(rows, RESPONSE, generator=g)})


def pg_loss(out: dict, cols: dict, ctx) -> tuple[torch.Tensor, dict]:
    loss = agg_loss(-out["log_probs"] * cols["advantages"], cols["response_mask"], "token-mean", **ctx.norms)
    return loss, {"actor/pg_loss": float(loss.detach())}


def infer_and_update(engine, batch: Batch, sizes) -> tuple[torch.Tensor, dict]:
    """The engine's log-probs of `batch`, then the metrics of one update on it (one mini-batch, one epoch)."""
    from hyflow.workers.train_engine import UpdatePlan

    log_probs = engine.infer(batch, sizes)["log_probs"]
    plan = UpdatePlan(mini_batch_size=len(batch), epochs=1, shuffle=False, seed=0, sizes=sizes,
                      loss_agg_mode="token-mean", metric_prefix="actor")
    metrics = engine.update(batch, plan, pg_loss, columns=("advantages", "response_mask"))
    return log_probs, metrics
