"""The model behind `hyflow serve`: one base model, a LoRA adapter per training run, their optimizers, snapshots.

`ModelHost` knows no HTTP (`hyflow.serve.app` does): the service's one worker thread calls it, one request at a
time, so a run's adapter, gradients and optimizer are touched by nobody else. Multi-LoRA: every training run is a
named peft adapter on the one shared base model; a forward activates the run's adapter (the others are not in
the graph, so their gradients and weights cannot move); `optim_step` is AdamW over the run's own LoRA factors.

Files (under `store`), written without pickle and read without running code:
- `runs/<run>/weights/<name>/adapter.safetensors` + `state.json` (+ `optimizer.safetensors`: exp_avg /
  exp_avg_sq per parameter, with the step count in state.json): `save_state` / `save_weights`;
- `runs/<run>/sampler_weights/<name>/adapter.safetensors` + `state.json`: what a sampling client samples with.
A Tinker path `tinker://<run>/weights/<name>` names the first, `tinker://<run>/sampler_weights/<name>` the second.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hyflow.algos.tinker_losses import LOSS_INPUTS, elementwise, loss_settings
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.models.logprobs import logprobs_from_logits
from hyflow.rollout.base import SamplingParams, TokenRequest
from hyflow.rollout.hf import HFRolloutEngine

LORA_ALPHA = 32  # peft's lora_alpha for every adapter (the scale is alpha / rank, as Tinker's LoRA runs)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_RUN_ID = re.compile(r"^session-[0-9a-f]{12}:train:[0-9]{1,9}$")


class ServeError(ValueError):
    """A request the service refuses: the message names the problem and the fix (a 4xx for the client)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> list[str]:
        return [*(ATTENTION if self.train_attn else ()), *(MLP if self.train_mlp else ()),
                *(UNEMBED if self.train_unembed else ())]

    def to_json(self) -> dict:
        return {"rank": self.rank, "seed": self.seed, "train_attn": self.train_attn, "train_mlp": self.train_mlp,
                "train_unembed": self.train_unembed}


@dataclass
class Datum:
    """One training example: input token ids [T] and its loss inputs (each [T], aligned with the targets)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass
class Run:
    run_id: str
    owner: str
    lora: LoraSpec
    adapter: str
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    last_request: float = field(default_factory=time.time)
    steps: int = 0
    closing: bool = False  # its session ended: an unload is queued, new calls get 404


@dataclass(frozen=True)
class SampleAsk:
    """One sample call's part of a decoding batch: its prompt, how many samples, their budget and first seed."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    seed: int | None


@dataclass
class Sample:
    tokens: list[int]
    log_probs: list[float]
    stop_reason: str  # "stop" | "length"


class HostBase:
    """What every host of `hyflow serve` shares, whatever holds the model: the runs' registry and ownership, the
    checkpoint store, and the checks of a request's data and prompts against the tokenizer and the model's shape."""

    def __init__(self, model_path: str | Path, *, name: str, store: str | Path, max_runs: int,
                 max_forward_tokens: int) -> None:
        self.model_path = str(model_path)
        self.name = name
        self.store = Path(store).expanduser()
        self.store.mkdir(parents=True, exist_ok=True)
        self.max_runs = max_runs
        self.max_forward_tokens = max_forward_tokens
        self.tokenizer = load_tokenizer(self.model_path, config_key="--model")
        self.runs: dict = {}
        # set by the subclass once it knows the model: vocab_size, context_length, config, arch

    def _check_new_run(self, owner: str, run_id: str, base_model: str, lora: LoraSpec):
        """The run already made by this very request (a retried create), None for a new one; ServeError naming
        what is wrong otherwise."""
        if run_id in self.runs and self.runs[run_id].owner == owner and self.runs[run_id].lora == lora:
            return self.runs[run_id]
        if run_id in self.runs:
            raise ServeError(f"training run {run_id!r} exists already", 409)
        if base_model != self.name:
            raise ServeError(f"base_model {base_model!r} is not served here; this service serves {self.name!r} "
                             "(hyflow serve --model PATH --name NAME)", 400)
        if lora.rank < 1:
            raise ServeError(f"lora rank must be >= 1, got {lora.rank}")
        if not lora.targets():
            raise ServeError("a LoRA run needs at least one of train_attn, train_mlp, train_unembed")
        if len(self.runs) >= self.max_runs:
            raise ServeError(f"this service holds {self.max_runs} training runs already (--max-runs); a run is "
                             "unloaded when its client's session ends (no heartbeat for 5 minutes), or start the "
                             "service with a larger --max-runs", 429)
        if not _RUN_ID.match(run_id):
            raise ServeError(f"training run id {run_id!r} is not of the form SESSION:train:N")
        return None

    def run_of(self, run_id: str, owner: str) -> Run:
        run = self.runs.get(run_id)
        if run is None or run.owner != owner or run.closing:  # another key's run is as unknown as a missing one
            raise ServeError(f"no training run {run_id!r} for this API key (create one with "
                             "create_lora_training_client)", 404)
        run.last_request = time.time()
        return run

    def _check_datum(self, index: int, datum: Datum, loss_fn: str) -> Datum:
        needed = LOSS_INPUTS.get(loss_fn, ())
        missing = [k for k in needed if k not in datum.inputs]
        if missing:
            raise ServeError(f"datum {index}: loss_fn {loss_fn!r} needs loss_fn_inputs {list(needed)}; missing "
                             f"{missing}")
        extra = sorted(set(datum.inputs) - set(needed))
        if extra:
            raise ServeError(f"datum {index}: loss_fn_inputs {extra} are not read by {loss_fn!r} (it reads "
                             f"{list(needed)})")
        n = len(datum.tokens)
        if n == 0:
            raise ServeError(f"datum {index} has no input tokens")
        if self.context_length is not None and n > self.context_length:
            raise ServeError(f"datum {index} has {n} tokens; the model takes {self.context_length} at most "
                             "(its max_position_embeddings)")
        for key, value in datum.inputs.items():
            if value.dim() != 1 or value.shape[0] != n:
                raise ServeError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; it must be "
                                 f"[{n}], one value per input token (position i predicts target_tokens[i])")
        bad = [t for t in [*datum.tokens, *datum.inputs["target_tokens"].tolist()] if not 0 <= t < self.vocab_size]
        if bad:
            raise ServeError(f"datum {index}: token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {self.vocab_size})")
        inputs = {k: (v.long() if k == "target_tokens" else v.float()) for k, v in datum.inputs.items()}
        return Datum(datum.tokens, inputs)

    def _dir(self, run: Run, kind: str, name: str) -> Path:
        if not _NAME.match(name):
            raise ServeError(f"checkpoint name {name!r} must be 1-128 letters, digits, '_', '.', '-' (no '/')")
        return self.store / "runs" / run.run_id / kind / name

    def resolve(self, tinker_path: str, owner: str) -> tuple[Run | None, Path, dict]:
        """The files of a Tinker path this key may read: (its run if still loaded, directory, state.json)."""
        match = re.match(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$", tinker_path or "")
        if not match:
            raise ServeError(f"{tinker_path!r} is not a checkpoint path of this service (tinker://RUN/weights/NAME "
                             "or tinker://RUN/sampler_weights/NAME)")
        run_id, kind, name = match.groups()
        owner_file = self.store / "runs" / run_id / "owner"
        if not _RUN_ID.match(run_id) or not _NAME.match(name) or not owner_file.is_file() or \
                owner_file.read_text() != owner:
            raise ServeError(f"no checkpoint {tinker_path!r} for this API key", 404)
        directory = self.store / "runs" / run_id / kind / name
        try:
            state = json.loads((directory / "state.json").read_text())
        except FileNotFoundError:
            raise ServeError(f"no checkpoint {tinker_path!r} for this API key", 404) from None
        except (OSError, ValueError) as exc:
            raise ServeError(f"checkpoint {tinker_path!r} is corrupt: state.json unreadable ({exc})", 422) from exc
        return self.runs.get(run_id), directory, state

    def checkpoints(self, run_id: str, owner: str) -> list[dict]:
        owner_file = self.store / "runs" / run_id / "owner"
        if not _RUN_ID.match(run_id) or not owner_file.is_file() or owner_file.read_text() != owner:
            raise ServeError(f"no training run {run_id!r} for this API key", 404)
        found = []
        for kind, checkpoint_type in (("weights", "training"), ("sampler_weights", "sampler")):
            for directory in sorted((self.store / "runs" / run_id / kind).glob("*")):
                if directory.name.endswith(".tmp") or not (directory / "state.json").is_file():
                    continue
                size = sum(f.stat().st_size for f in directory.iterdir())
                try:
                    metadata = json.loads((directory / "state.json").read_text()).get("user_metadata") or None
                except (OSError, ValueError):
                    metadata = None
                found.append({"user_metadata": metadata,
                              "checkpoint_id": f"{kind}/{directory.name}", "checkpoint_type": checkpoint_type,
                              "time": (directory / "state.json").stat().st_mtime, "size_bytes": size,
                              "tinker_path": f"tinker://{run_id}/{kind}/{directory.name}"})
        return found

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, owner: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        _, directory, _ = self.resolve(f"tinker://{run_id}/{kind}/{name}", owner)
        shutil.rmtree(directory)

    def record_owner(self, run: Run) -> None:
        directory = self.store / "runs" / run.run_id
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "owner").write_text(run.owner)

    def check_prompt(self, prompt: list[int], max_tokens: int = 0) -> None:
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad or not prompt:
            raise ServeError(f"the prompt has {'no tokens' if not prompt else f'token id {bad[0]} outside the vocabulary'}"
                             f" (vocabulary size {self.vocab_size})")
        if self.context_length is not None and len(prompt) + max_tokens > self.context_length:
            raise ServeError(f"the prompt's {len(prompt)} tokens + max_tokens {max_tokens} exceed the model's context "
                             f"of {self.context_length} tokens (its max_position_embeddings)")


class ModelHost(HostBase):
    """One base model and its training runs in this process (module docstring)."""

    def __init__(self, model_path: str | Path, *, name: str, store: str | Path, device: str = "cpu",
                 dtype: str = "float32", max_runs: int = 64, max_forward_tokens: int = 16384) -> None:
        super().__init__(model_path, name=name, store=store, max_runs=max_runs, max_forward_tokens=max_forward_tokens)
        self.device = torch.device(device)
        self.model = load_causal_lm(self.model_path, dtype=dtype, device=self.device, config_key="--model")
        self.model.requires_grad_(False)
        self.peft = None  # the peft wrapper, made at the first training run
        self.runs: dict[str, Run] = {}
        self._adapters = 0
        self._slots: dict[LoraSpec, Run] = {}
        eos = self.tokenizer.eos_token_id
        self.engine = HFRolloutEngine(self.model, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)
        self.config, self.arch = self.model.config, type(self.model).__name__

    # ------------------------------------------------------------------ runs
    def create_run(self, owner: str, run_id: str, base_model: str, lora: LoraSpec) -> Run:
        """A new run `run_id` (the SDK's `<session>:train:<n>`); the same id again (a retried create) is the
        same run."""
        existing = self._check_new_run(owner, run_id, base_model, lora)
        if existing is not None:
            return existing
        self._adapters += 1
        adapter = f"run{self._adapters}"
        self._add_adapter(adapter, lora)
        params = self._adapter_params(adapter)
        for p in params.values():
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0)
        run = Run(run_id, owner, lora, adapter, params, optimizer)
        self.runs[run_id] = run
        return run

    def _add_adapter(self, adapter: str, lora: LoraSpec) -> None:
        from peft import LoraConfig, get_peft_model

        present = {name.rsplit(".", 1)[-1] for name, _ in self.model.named_modules()}
        targets = [t for t in lora.targets() if t in present]
        if not targets:
            raise ServeError(f"the served model has none of the modules {lora.targets()} that this LoRA config "
                             "trains")
        config = LoraConfig(r=lora.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                            bias="none", task_type="CAUSAL_LM")
        seed = lora.seed if lora.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        with _seeded(seed), warnings.catch_warnings():
            # transformers' own deprecation inside peft; peft's note on a tied lm_head: the adapter's delta is on
            # the head only, the shared embedding matrix stays frozen and no adapter is ever merged here
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*ensure_weight_tying")
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, config)
        self.peft.set_adapter(adapter)

    def _adapter_params(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's LoRA factors, keyed by names without the adapter's own name (so a checkpoint fits any
        adapter of the same LoRA shape)."""
        return {name.replace(f".{adapter}.", ".adapter."): p for name, p in self.peft.named_parameters()
                if f".{adapter}." in name}

    def unload(self, run: Run) -> None:
        """Drop a run's adapter and optimizer (its files stay). The last adapter takes the peft wrapper with it
        (peft keeps no model without an adapter): the base model is plain again, as before the first run.
        Unloading a run that is gone already does nothing."""
        if self.runs.get(run.run_id) is not run:
            return
        del self.runs[run.run_id]
        left = [r.adapter for r in [*self.runs.values(), *self._slots.values()]]
        if not left:
            self.peft.unload()  # puts the base layers back in place: self.model is the same module
            self.peft = None
            return
        self.peft.delete_adapter(run.adapter)
        self.peft.set_adapter(left[0])

    def _live(self, run: Run) -> None:
        """A call queued before its run was unloaded (its session ended) finds it gone: 404, nothing touched."""
        if self.runs.get(run.run_id) is not run and run not in self._slots.values():
            raise ServeError(f"no training run {run.run_id!r}: it was unloaded before this call ran", 404)

    @contextlib.contextmanager
    def _active(self, run: Run) -> Iterator[None]:
        self._live(run)
        self.peft.set_adapter(run.adapter)  # the PeftModel's own record too (its forward reads that one's config)
        for p in run.params.values():  # set_adapter may reset requires_grad of the adapter it activates
            p.requires_grad_(True)
        yield

    # ------------------------------------------------------------------ training
    def forward_backward(self, run: Run, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None,
                         *, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """The loss's per-token log-probs of every datum, and `loss:sum`; gradients add up until `optim_step`.

        The data run in micro-batches of at most `max_forward_tokens` padded tokens (memory is bounded whatever the
        request's size; the loss is a sum, so the gradients are the same). A call that fails part-way (a loss that
        is not finite) leaves the run's gradients as they were before it."""
        settings = checked_loss_settings(loss_fn, loss_fn_config)
        checked = [self._check_datum(i, d, loss_fn) for i, d in enumerate(data)]
        if not checked:
            raise ServeError("forward_backward got no data")
        before = None if forward_only else {n: None if p.grad is None else p.grad.clone()
                                            for n, p in run.params.items()}
        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        try:
            with self._active(run), torch.set_grad_enabled(not forward_only):
                for chunk in _chunks(checked, self.max_forward_tokens):
                    chunk_outputs, loss = self._forward_chunk(chunk, loss_fn, settings)
                    if not torch.isfinite(loss):
                        raise ServeError(f"the {loss_fn} loss is {loss.item()} (not finite); check the request's "
                                         "advantages, weights and sampler logprobs for NaN/inf")
                    if not forward_only:
                        loss.backward()
                    outputs += chunk_outputs
                    total += float(loss.detach())
        except BaseException:
            if before is not None:
                for n, p in run.params.items():
                    p.grad = before[n]
            raise
        return outputs, {"loss:sum": total}

    def _forward_chunk(self, chunk: list[Datum], loss_fn: str, settings: dict) -> tuple[list[dict], torch.Tensor]:
        lengths = [len(d.tokens) for d in chunk]
        width = max(lengths)
        ids = torch.full((len(chunk), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        targets = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, d in enumerate(chunk):
            ids[row, : len(d.tokens)] = torch.tensor(d.tokens)
            mask[row, : len(d.tokens)] = 1
            targets[row, : len(d.tokens)] = d.inputs["target_tokens"]
        logits = self.peft(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        target_log_probs = logprobs_from_logits(logits, targets.to(self.device))
        per_datum = [elementwise(loss_fn, target_log_probs[row, :n],
                                 {k: v.to(self.device) for k, v in chunk[row].inputs.items()}, settings)
                     for row, n in enumerate(lengths)]
        outputs = [{"logprobs": target_log_probs[row, :n].detach().float().cpu(),
                    "elementwise_loss": per_datum[row].detach().float().cpu()} for row, n in enumerate(lengths)]
        return outputs, torch.stack([x.sum() for x in per_datum]).sum()

    def optim_step(self, run: Run, *, learning_rate: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step of the run's adapter with this call's hyper-parameters; gradients are cleared."""
        self._live(run)
        check_adam(learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                   grad_clip_norm=grad_clip_norm)
        params = list(run.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads \
            else torch.tensor(0.0)
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
        for group in run.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.steps += 1
        return {"grad_norm": float(norm), "learning_rate": learning_rate}

    # ------------------------------------------------------------------ checkpoints
    def save(self, run: Run, name: str, *, kind: str, optimizer: bool, overwrite: bool = True,
             user_metadata: dict | None = None) -> str:
        """Write the adapter (and the optimizer state) under `kind` ('weights' / 'sampler_weights'); its path. An
        existing checkpoint of that name is replaced only with `overwrite`."""
        self._live(run)
        out = self._dir(run, kind, name)
        if out.exists() and not overwrite:
            raise ServeError(f"checkpoint tinker://{run.run_id}/{kind}/{name} exists already; save under another "
                             "name or pass overwrite=True", 409)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({n: p.detach().cpu().contiguous() for n, p in run.params.items()},
                  str(tmp / "adapter.safetensors"))
        state = {"format": "hyflow-serve-1", "base_model": self.name, "lora": run.lora.to_json(),
                 "steps": run.steps, "time": time.time(), "optimizer": False,
                 "user_metadata": dict(user_metadata or {})}
        if optimizer:
            tensors, adam_steps = {}, {}
            for n, p in run.params.items():
                slot = run.optimizer.state.get(p, {})
                if slot:
                    tensors[f"exp_avg/{n}"] = slot["exp_avg"].detach().cpu().contiguous()
                    tensors[f"exp_avg_sq/{n}"] = slot["exp_avg_sq"].detach().cpu().contiguous()
                    adam_steps[n] = float(slot["step"])
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            state.update(optimizer=True, adam_steps=adam_steps)
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return f"tinker://{run.run_id}/{kind}/{name}"

    def load(self, run: Run, directory: Path, state: dict, *, optimizer: bool, tinker_path: str) -> None:
        """Put a saved adapter (and optimizer state) into `run`; the shapes must match its LoRA config."""
        self._live(run)
        if state.get("lora", {}).get("rank") != run.lora.rank:
            raise ServeError(f"{tinker_path!r} holds a rank-{state.get('lora', {}).get('rank')} adapter; this run "
                             f"has rank {run.lora.rank}")
        tensors = _load_tensors(directory / "adapter.safetensors", tinker_path)
        if set(tensors) != set(run.params) or any(tensors[n].shape != p.shape for n, p in run.params.items()):
            raise ServeError(f"{tinker_path!r} does not fit this run: its adapter covers other modules "
                             "(train_attn/train_mlp/train_unembed differ)")
        moments: dict[str, dict] = {}
        if optimizer:  # everything is read and checked before anything of the run changes
            if not state.get("optimizer"):
                raise ServeError(f"{tinker_path!r} was saved without optimizer state (save_weights_for_sampler); "
                                 "load it with load_state, or save with save_state")
            saved = _load_tensors(directory / "optimizer.safetensors", tinker_path)
            try:
                for n, p in run.params.items():
                    if f"exp_avg/{n}" in saved:
                        moments[n] = {"step": torch.tensor(float(state["adam_steps"][n])),
                                      "exp_avg": saved[f"exp_avg/{n}"].to(p.device),
                                      "exp_avg_sq": saved[f"exp_avg_sq/{n}"].to(p.device)}
            except (KeyError, TypeError, ValueError) as exc:
                raise ServeError(f"checkpoint {tinker_path!r} is corrupt: its optimizer state is incomplete ({exc})",
                                 422) from exc
        with torch.no_grad():
            for n, p in run.params.items():
                p.copy_(tensors[n].to(p.device, p.dtype))
        run.optimizer.state.clear()
        for n, p in run.params.items():
            if n in moments:
                run.optimizer.state[p] = moments[n]
        run.steps = int(state.get("steps", 0))

    # ------------------------------------------------------------------ sampling
    def sample(self, asks: list[SampleAsk], params: SamplingParams,
               adapter: tuple[Run, dict[str, torch.Tensor]] | None) -> list[list[Sample]]:
        """Each ask's `num_samples` continuations of its prompt, all asks decoded as one batch, with the base model
        (adapter None) or a run's adapter set to the given weights for this call (a sampler checkpoint); sample i of
        an ask is seeded `seed + i`, at most `max_tokens` new tokens (`params.max_new_tokens` caps them all)."""
        for ask in asks:
            self.check_prompt(ask.prompt, ask.max_tokens)
        requests = [TokenRequest(request_id=f"{a}.{i}", prompt_ids=list(ask.prompt), max_tokens=ask.max_tokens,
                                 seed=None if ask.seed is None else ask.seed + i)
                    for a, ask in enumerate(asks) for i in range(ask.num_samples)]
        with self._weights_for_sampling(adapter):
            outputs = iter(self.engine.generate_requests(requests, params))
        return [[Sample(list(o.token_ids), list(o.log_probs or []), "stop" if o.stop_reason == "stop" else "length")
                 for o in (next(outputs) for _ in range(ask.num_samples))] for ask in asks]

    @contextlib.contextmanager
    def _weights_for_sampling(self, adapter: tuple[Run, dict[str, torch.Tensor]] | None) -> Iterator[None]:
        if adapter is None:
            context = self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
            with context:
                yield
            return
        run, tensors = adapter
        with torch.no_grad():
            kept = {n: p.detach().clone() for n, p in run.params.items()}
            try:
                for n, p in run.params.items():
                    p.copy_(tensors[n].to(p.device, p.dtype))
                with self._active(run):
                    yield
            finally:
                for n, p in run.params.items():
                    p.copy_(kept[n])

    def _sampling_slot(self, lora: LoraSpec) -> Run:
        """An adapter of this LoRA shape that no client trains: sampler checkpoints of runs no longer loaded are
        copied into it for the length of a sample call."""
        if lora not in self._slots:
            self._adapters += 1
            adapter = f"slot{self._adapters}"
            self._add_adapter(adapter, lora)
            params = self._adapter_params(adapter)
            self._slots[lora] = Run(f"slot:{adapter}", "", lora, adapter, params, torch.optim.AdamW(
                list(params.values()), lr=0.0))
        return self._slots[lora]

    def sampler_weights(self, tinker_path: str, owner: str) -> tuple[Run, dict[str, torch.Tensor]]:
        run, directory, state = self.resolve(tinker_path, owner)
        if run is None:  # its run is gone (unloaded, or an earlier start of the service): a slot of its shape
            run = self._sampling_slot(LoraSpec(**{**state["lora"], "seed": 0}))
        tensors = _load_tensors(directory / "adapter.safetensors", tinker_path)
        if set(tensors) != set(run.params):
            raise ServeError(f"{tinker_path!r} does not fit its run's adapter", 422)
        return run, tensors


def checked_loss_settings(loss_fn: str, config: dict | None) -> dict[str, float]:
    try:
        return loss_settings(loss_fn, config)
    except ValueError as exc:  # an unknown loss or key is the client's to fix
        raise ServeError(str(exc)) from exc


def check_adam(*, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               grad_clip_norm: float) -> None:
    for name, value in (("learning_rate", learning_rate), ("eps", eps), ("weight_decay", weight_decay),
                        ("grad_clip_norm", grad_clip_norm)):
        if not math.isfinite(value) or value < 0:
            raise ServeError(f"adam_params.{name} must be a finite number >= 0, got {value}")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ServeError(f"adam_params.beta1/beta2 must be in [0, 1), got {beta1} / {beta2}")


def _chunks(data: list[Datum], budget: int) -> Iterator[list[Datum]]:
    """Consecutive data in groups of at most `budget` padded tokens (rows x longest); a longer datum alone."""
    chunk: list[Datum] = []
    width = 0
    for datum in data:
        wider = max(width, len(datum.tokens))
        if chunk and wider * (len(chunk) + 1) > budget:
            yield chunk
            chunk, wider = [], len(datum.tokens)
        chunk.append(datum)
        width = wider
    if chunk:
        yield chunk


def _load_tensors(path: Path, tinker_path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ServeError(f"checkpoint {tinker_path!r} is incomplete: {path.name} is missing", 422) from None
    except Exception as exc:  # safetensors raises its own error types for truncated / foreign files
        raise ServeError(f"checkpoint {tinker_path!r} is corrupt: {path.name} cannot be read ({exc})", 422) from exc


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
