"""PRIME's implicit process reward model: a causal LM trained online from the outcome, beside a frozen reference.

(`hyflow.algos.prime` has the math; verl-recipe prime's `PRIMERewardModelWorker` / `DataParallelPRIMERewardModel`
is the model.) Per step the trainer calls, on the step's samples:

1. `compute_prm_ref_log_probs`: log pi_ref of every response token (the frozen reference, no grad), once;
2. `update_prm` (reward_model.model.update=before or after): mini-batches of the samples, each one optimizer step
   on the cross-entropy of the outcome, BCE(sigmoid(beta sum_t q_t), acc), q_t = log pi_phi - log pi_ref (the
   reference's log-probs are the column from 1.), normalised over the whole mini-batch on all ranks (micro-batch
   and data-parallel invariant, like the actor's loss). It returns the q of its own forwards (each mini-batch's,
   before that mini-batch's step): verl's scores with `update=after` (its single forward) and the source of its
   `reward_model/dpo_acc_before` metrics;
3. `compute_prm_q` (update=before or none): q_t with the PRM as it is now (after the update), which the trainer
   turns into the policy's implicit token rewards.

verl runs the reference's forward again in 2. and 3.; its values are the same each time (a frozen model on the
same tokens), so hyflow runs it once. Log-probs are at temperature 1 (the PRM scores the tokens, it does not
sample them), as in verl's PRM.

Several ranks (`reward_model.strategy` fsdp/fsdp2 = FSDP2, ddp): both models are wrapped as the actor's are; the
PRM's training state is checkpointed with the actor's (`EngineCheckpoints`, component prefix `prm_`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hyflow.algos.prime import implicit_q, prime_ce_loss_per_sample
from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.loading import load_causal_lm
from hyflow.specs import PRMSpec
from hyflow.workers.engine import apply_full_determinism, pad_response
from hyflow.workers.fsdp import maybe_init_distributed
from hyflow.workers.train_engine import EngineCheckpoints, TrainEngine, UpdatePlan, resolve_device

PRM_COLUMNS = ("prm_ref_log_probs", "prm_acc", "prm_row", "response_mask")


class ImplicitPRMWorker(EngineCheckpoints, Worker):
    """One rank of PRIME's implicit PRM (see the module docstring), built from its `PRMSpec`."""

    MESHES: ClassVar[dict[str, str]] = {"prm": "engine", "ref": "ref"}

    def __init__(self, spec: PRMSpec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.model_device = resolve_device(spec.engine.device, self.local_rank)

    def set_progress(self, progress) -> None:
        """In-step progress of the PRM's update (the trainer's bar; None to stop). In-process only."""
        if getattr(self, "engine", None) is not None:
            self.engine.progress = progress

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the PRM (trainable, with its optimizer and LR schedule) and its frozen reference."""
        spec = self.spec
        apply_full_determinism(spec.full_determinism)
        maybe_init_distributed(self)
        torch.manual_seed(spec.seed + 2)
        load = {"dtype": "float32", "trust_remote_code": spec.model.trust_remote_code, "device": self.model_device}
        model = load_causal_lm(spec.model.path, override_config=dict(spec.model.override_config),
                               enable_gradient_checkpointing=spec.model.enable_gradient_checkpointing,
                               config_key=spec.model.config_key, **load)
        ref = load_causal_lm(spec.ref_model.path, override_config=dict(spec.ref_model.override_config),
                             config_key=spec.ref_model.config_key, **load)
        self.engine = TrainEngine.from_spec(model, spec.engine, device=self.model_device, world_size=self.world_size)
        self.ref = TrainEngine.from_spec(ref, spec.ref_engine, device=self.model_device, world_size=self.world_size)
        self.model = self.engine.model
        if self.rank == 0:
            print(f"PRIME implicit PRM: {self.engine.describe_parameters()}", flush=True)

    @register(Dispatch.DP_SPLIT, mesh="ref")
    def compute_prm_ref_log_probs(self, batch: Batch) -> Batch:
        """`prm_ref_log_probs` [N, R]: the frozen reference's log-probs of the response tokens (0 off the mask)."""
        with self.ref.on_device():
            return Batch({"prm_ref_log_probs": self.ref.infer(batch, self.spec.forward)["log_probs"]})

    @register(Dispatch.DP_SPLIT, mesh="prm")
    def compute_prm_q(self, batch: Batch) -> Batch:
        """`prm_q` [N, R] = log pi_phi - log pi_ref per response token (0 off the mask), with the PRM as it is
        now; needs the `prm_ref_log_probs` column."""
        with self.engine.on_device():
            log_probs = self.engine.infer(batch, self.spec.forward)["log_probs"]
        return Batch({"prm_q": implicit_q(log_probs, batch["prm_ref_log_probs"], batch["response_mask"])})

    @register(Dispatch.DP_MINI_BATCHES, pad=False, mesh="prm")
    def update_prm(self, batch: Batch) -> Batch:
        """One pass over this rank's samples in mini-batches, one optimizer step each, on the outcome's cross-entropy
        (`prm_acc`: the outcome broadcast over the response columns; `prm_ref_log_probs`; `prm_row`: each row's
        number, broadcast likewise). Returns this rank's rows with the q of the update's own forward (`prm_q` [n, R],
        0 off the mask) and their numbers (`prm_row` [n]), sorted by number, and verl's `reward_model/dpo_loss`,
        `reward_model/grad_norm` and `rm/lr` metrics."""
        beta = self.spec.beta
        R = batch["responses"].shape[1]
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row numbers, q) of each micro-batch's forward

        def loss_fn(out: dict, cols: dict, ctx) -> tuple[torch.Tensor, dict]:
            mask = cols["response_mask"].bool()
            q = implicit_q(out["log_probs"], cols["prm_ref_log_probs"], mask)
            seen.append((cols["prm_row"][:, 0].long().cpu(), pad_response(q.detach().float().cpu(), R)))
            per_row = prime_ce_loss_per_sample(q, cols["prm_acc"][:, 0], mask, beta=beta)
            seqs = max(float(ctx.norms["global_seq_count"]), 1.0)
            loss = (per_row * mask.any(-1)).sum() / seqs
            return loss, {"reward_model/dpo_loss": float(loss.detach())}

        sizes = self.spec.batches
        plan = UpdatePlan(mini_batch_size=max(1, int(sizes.samples_per_device)), epochs=1, shuffle=False,
                          sizes=sizes, seed=0, loss_agg_mode="seq-mean-token-sum", metric_prefix="reward_model")
        with self.engine.on_device(optimizer=True):
            metrics = self.engine.update(batch, plan, loss_fn, columns=PRM_COLUMNS)
        metrics["rm/lr"] = metrics.pop("reward_model/lr")
        rows = torch.cat([r for r, _ in seen])
        q = torch.cat([v for _, v in seen])
        order = torch.argsort(rows)
        return Batch({"prm_q": q[order], "prm_row": rows[order]}, meta={"metrics": metrics})
