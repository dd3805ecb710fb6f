"""The reward-model worker: a discriminative reward model (a sequence classifier with one output) scores samples.

`compute_rm_score(batch)` returns a Batch with one column, `rm_scores` [N, R] float32, in verl's layout: the
reward model's scalar score r_i of sample i sits at its last valid response token, zeros elsewhere,

    rm_scores[i, len_i - 1] = r_i,   len_i = sum_t attention_mask[i, P + t]   (responses are right-padded),

and a sample with an empty response (len_i = 0) gets a row of zeros. This is the same layout as the reward
managers' `token_level_scores`, so the two can be added or swapped position for position. How they are
combined is the trainer's choice (verl: with `reward_model.enable`, the reward-model score is the reward unless
a custom reward function is configured).

r_i = score_head(h_last), the classifier head applied to the final hidden state of the last attended token
(`hyflow.models.forward.reward_scores`), as in `AutoModelForSequenceClassification` with `num_labels=1`.

Two input paths (verl's `reward_model.model.input_tokenizer` switch):

- Same tokenizer: when the policy's tokenizer and the reward model's have the same class, vocabulary and
  special tokens, the policy's own `input_ids` / `attention_mask` / `position_ids` are scored as they are (no
  re-tokenisation; the file name or path of the tokenizer does not matter).
- Different tokenizer: each sample is turned back into text with the policy's tokenizer and re-rendered as
  a chat with the reward model's chat template,

      chat_i = raw_prompt_i (the dataset's chat messages)  or  [{"role": "user", "content": decoded prompt}]
               + [{"role": "assistant", "content": decoded response}],

  decoded with `skip_special_tokens=True` (so the response's EOS is dropped). The rendered text is tokenised
  with the reward model's tokenizer (no extra special tokens: the template carries them), cut on the right to
  `reward_model.max_length` tokens when that is set (verl's default truncation side), right-padded and scored.

The forward runs through the training engine (`TrainEngine` with head "score", no optimizer: eval mode, no
gradients, autocast in `fsdp_config.dtype` on accelerators), micro-batched as the spec derives
(`hyflow.config.roles.reward_model_spec`, the one micro-batch rule of every role):
`reward_model.micro_batch_size_per_gpu` samples per forward, else verl's global
`reward_model.micro_batch_size` / data-parallel size (which must divide evenly), else all of this rank's
samples at once; or token-budget packing with `reward_model.use_dynamic_bsz` and
`reward_model.forward_max_token_len_per_gpu`. Columns that are padding in every row of a micro-batch are cut
before the forward pass. The worker itself keeps only what is the reward model's own: re-tokenisation and
placing the score at the last response token.
"""

from __future__ import annotations

import importlib

import torch

from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.forward import compute_position_ids
from hyflow.models.loading import load_reward_model, load_tokenizer
from hyflow.specs import RewardModelSpec
from hyflow.workers.engine import SEQUENCE_KEYS, apply_full_determinism
from hyflow.workers.train_engine import TrainEngine, resolve_device


def same_tokenizer(a, b) -> bool:
    """Whether token ids of tokenizer `a` mean the same text to tokenizer `b`.

    True when both are the same object, or have the same class, the same token -> id vocabulary and the
    same special tokens (pad, eos, bos, ...). Names and paths are not compared.
    """
    if a is b:
        return True
    return (
        type(a) is type(b)
        and a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
        and a.pad_token_id == b.pad_token_id
        and a.eos_token_id == b.eos_token_id
    )


def valid_response_lengths(batch: Batch) -> torch.Tensor:
    """len_i = number of attended response tokens [N] (responses are the last R columns, right-padded)."""
    R = batch["responses"].shape[1]
    return batch["attention_mask"][:, -R:].sum(-1).long()


def scores_at_last_response_token(scores_N: torch.Tensor, lengths_N: torch.Tensor, R: int) -> torch.Tensor:
    """[N, R] float32: out[i, len_i - 1] = scores_N[i], zeros elsewhere; an all-zero row where len_i = 0."""
    out_NR = torch.zeros(len(scores_N), R, dtype=torch.float32)
    rows = torch.arange(len(scores_N))
    last = (lengths_N - 1).clamp(min=0)
    out_NR[rows, last] = scores_N.float() * (lengths_N > 0).float()
    return out_NR


def _as_messages(raw_prompt) -> list[dict]:
    """A chat-message list from a `raw_prompt` entry (list or numpy array of dicts, or a plain string)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(message) for message in list(raw_prompt)]


def policy_chats(batch: Batch, policy_tokenizer) -> list[list[dict]]:
    """Per sample: its prompt messages + {"role": "assistant", "content": decoded response}.

    Prompt messages come from the `raw_prompt` column when the batch has it; otherwise the valid prompt
    tokens are decoded with `policy_tokenizer` (special tokens skipped) into one user message.
    """
    P = batch["prompts"].shape[1]
    R = batch["responses"].shape[1]
    prompt_mask = batch["attention_mask"][:, :P].bool()
    response_mask = batch["attention_mask"][:, -R:].bool()
    raw_prompts = batch.non_tensors.get("raw_prompt")
    chats = []
    for i in range(len(batch)):
        if raw_prompts is not None:
            messages = _as_messages(raw_prompts[i])
        else:
            prompt_ids = batch["prompts"][i][prompt_mask[i]].tolist()
            messages = [{"role": "user", "content": policy_tokenizer.decode(prompt_ids, skip_special_tokens=True)}]
        response_ids = batch["responses"][i][response_mask[i]].tolist()
        response = policy_tokenizer.decode(response_ids, skip_special_tokens=True)
        chats.append([*messages, {"role": "assistant", "content": response}])
    return chats


def tokenize_chats(chats: list[list[dict]], rm_tokenizer, max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Render each chat with the reward model's chat template and tokenise it: right-padded [N, L] tensors.

    Each text is cut on the right to `max_length` tokens when given; L = the longest kept length.
    Returns `input_ids`, `attention_mask` and `position_ids` (0, 1, 2, ... over the real tokens).
    """
    if not getattr(rm_tokenizer, "chat_template", None):
        raise ValueError(
            f"the reward model's tokenizer ({rm_tokenizer.name_or_path!r}) has no chat template, so the policy's "
            "samples cannot be re-rendered for it; add a chat_template to its tokenizer_config.json, or use a "
            "reward model with the policy's tokenizer"
        )
    texts = [rm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False) for chat in chats]
    ids_per_text = [rm_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if max_length is not None:
        ids_per_text = [ids[:max_length] for ids in ids_per_text]
    width = max(1, max(len(ids) for ids in ids_per_text))
    pad_id = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else rm_tokenizer.eos_token_id
    input_ids = torch.full((len(texts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, ids in enumerate(ids_per_text):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask)}


class RewardModelWorker(Worker):
    """A frozen sequence-classification reward model on one device; scores this rank's share of the samples."""

    def __init__(self, spec: RewardModelSpec, tokenizer=None, **kwargs) -> None:
        """`spec` from `hyflow.config.roles.reward_model_spec`; `tokenizer` is the policy's (what produced the
        batch's token ids), loaded in `init_model` from `spec.policy_tokenizer` if None."""
        super().__init__(**kwargs)
        self.spec = spec
        self.policy_tokenizer = tokenizer
        self.model_device = resolve_device(spec.engine.device, self.local_rank)

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the reward model (`reward_model.model.path`) and its tokenizer into a forward-only engine; decide
        whether to re-tokenise.

        The policy's tokenizer is the one given to the constructor, else `reward_model.model.input_tokenizer`,
        else `actor_rollout_ref.model.tokenizer_path` / `.path`. Every rank holds the whole model.
        """
        spec, model_spec = self.spec, self.spec.model
        apply_full_determinism(spec.full_determinism)
        if not model_spec.path:
            raise ValueError(
                "reward_model.model.path is not set, but the reward-model worker needs it: set "
                "reward_model.model.path=DIR (a sequence-classification checkpoint with num_labels=1), or "
                "reward_model.enable=False to score with rule-based functions only"
            )
        if spec.external_lib:
            importlib.import_module(spec.external_lib)
        self.rm_tokenizer = load_tokenizer(model_spec.path, trust_remote_code=model_spec.trust_remote_code,
                                           config_key=model_spec.config_key)
        if self.policy_tokenizer is None:
            self.policy_tokenizer = self._load_policy_tokenizer()
        self.retokenize = not same_tokenizer(self.policy_tokenizer, self.rm_tokenizer)
        dtype = "float32" if self.model_device.type == "cpu" else spec.model_dtype
        model = load_reward_model(model_spec.path, dtype=dtype, trust_remote_code=model_spec.trust_remote_code,
                                  override_config=dict(model_spec.override_config), device=self.model_device,
                                  config_key=model_spec.config_key)
        # one whole copy per rank: the engine is built for this rank alone (world size 1, no wrapper)
        self.engine = TrainEngine.from_spec(model, spec.engine, device=self.model_device, world_size=1)
        self.model = self.engine.model

    def _load_policy_tokenizer(self):
        tokenizer = self.spec.policy_tokenizer
        if tokenizer is None:
            raise ValueError(
                "the reward-model worker needs the policy's tokenizer to read the samples: pass tokenizer=... "
                "to RewardModelWorker, or set reward_model.model.input_tokenizer (or actor_rollout_ref.model.path)"
            )
        return load_tokenizer(tokenizer.path, trust_remote_code=tokenizer.trust_remote_code,
                              config_key=tokenizer.config_key)

    def _reward_model_inputs(self, batch: Batch) -> Batch:
        """The [N, L] tensors the reward model reads: the policy's own, or the re-rendered chats' tokens."""
        if not self.retokenize:
            return batch.select(*SEQUENCE_KEYS)
        chats = policy_chats(batch, self.policy_tokenizer)
        return Batch(tokenize_chats(chats, self.rm_tokenizer, self.spec.max_length))

    def _check_token_budget(self, inputs: Batch) -> None:
        budget = self.spec.max_token_len_per_device
        longest = int(inputs["attention_mask"].sum(-1).max()) if len(inputs) else 0
        if self.spec.use_dynamic_bsz and longest > budget:
            raise ValueError(
                f"a reward-model input has {longest} tokens, more than "
                f"reward_model.forward_max_token_len_per_gpu={budget}; raise it, set reward_model.max_length, "
                f"or set reward_model.use_dynamic_bsz=False"
            )

    @register(Dispatch.DP_SPLIT)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` [N, R]: the reward model's score at each sample's last valid response token, 0 elsewhere."""
        inputs = self._reward_model_inputs(batch)
        self._check_token_budget(inputs)
        scores_N = self.engine.infer(inputs, self.spec)["scores"]
        R = batch["responses"].shape[1]
        return Batch({"rm_scores": scores_at_last_response_token(scores_N, valid_response_lengths(batch), R)})
