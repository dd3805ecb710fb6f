"""A supervised fine-tuning loop written against the `tinker` SDK only (the shape of tinker-cookbook's
recipes/sl_loop.py: render conversations, weight the assistant's tokens, forward_backward with cross-entropy,
optim_step, save the weights for sampling), run against `hyflow serve`:

    hyflow serve --model MODEL_DIR --name tiny          # prints TINKER_BASE_URL and TINKER_API_KEY
    export TINKER_BASE_URL=... TINKER_API_KEY=...
    python examples/tinker/sl_loop.py --base-model tiny

Nothing here imports hyflow: the same file runs against any Tinker-compatible service.
"""

from __future__ import annotations

import argparse
import os

import tinker
from tinker import types

CONVERSATIONS = [
    [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": "The sky is blue."}],
    [{"role": "user", "content": "What colour is grass?"}, {"role": "assistant", "content": "Grass is green."}],
    [{"role": "user", "content": "What colour is snow?"}, {"role": "assistant", "content": "Snow is white."}],
    [{"role": "user", "content": "What colour is coal?"}, {"role": "assistant", "content": "Coal is black."}],
]


def conversation_datum(tokenizer, conversation: list[dict]) -> types.Datum:
    """Tokens of the whole conversation; weight 1 on the assistant's reply (and its end token), 0 on the prompt."""
    prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(conversation, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    weights = [0.0] * len(prompt_ids) + [1.0] * (len(ids) - len(prompt_ids))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights[1:]})


def main(base_url: str | None, api_key: str | None, base_model: str, *, steps: int = 20, lr: float = 1e-2,
         rank: int = 8, seed: int = 0, log=print) -> list[float]:
    """Train `steps` steps on CONVERSATIONS; the mean per-token loss of each step."""
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()
    tokenizer = training.get_tokenizer()
    data = [conversation_datum(tokenizer, c) for c in CONVERSATIONS]
    tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    losses = []
    for step in range(steps):
        learning_rate = lr * (1 - step / steps)  # linear decay, as the cookbook's loops do
        backward = training.forward_backward(data, loss_fn="cross_entropy")
        update = training.optim_step(types.AdamParams(learning_rate=learning_rate))
        loss = backward.result().metrics["loss:sum"] / tokens
        update.result()
        losses.append(loss)
        log(f"step {step + 1}/{steps}  loss {loss:.4f}  lr {learning_rate:.2e}")
    path = training.save_weights_for_sampler("sl-final").result().path
    log(f"sampler weights: {path}")
    service.close("success").result()  # ends the session: the service frees the adapter (checkpoints stay)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    main(os.environ.get("TINKER_BASE_URL"), os.environ.get("TINKER_API_KEY"), args.base_model, steps=args.steps,
         lr=args.lr, rank=args.rank)
