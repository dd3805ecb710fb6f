"""A reinforcement-learning loop written against the `tinker` SDK only (the shape of tinker-cookbook's
recipes/rl_loop.py: each iteration saves the weights for a sampling client, samples a group of answers per
prompt, scores them, centres the rewards within the group into advantages and takes one importance-sampling step),
run against `hyflow serve`:

    hyflow serve --model MODEL_DIR --name tiny
    export TINKER_BASE_URL=... TINKER_API_KEY=...
    python examples/tinker/rl_loop.py --base-model tiny

The task is a toy that any model can learn from scratch: the reward is the share of even token ids in the answer.
Nothing here imports hyflow.
"""

from __future__ import annotations

import argparse
import os

import tinker
from tinker import types

PROMPTS = ["the cat", "a dog ran"]


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def main(base_url: str | None, api_key: str | None, base_model: str, *, iterations: int = 12, group: int = 8,
         max_tokens: int = 6, lr: float = 3e-2, rank: int = 8, seed: int = 0, loss_fn: str = "importance_sampling",
         log=print) -> list[float]:
    """`iterations` RL steps; the mean reward of each iteration's samples (before its update)."""
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    means = []
    for iteration in range(iterations):
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 100_003 + iteration)
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=group, sampling_params=params)
                   for p in prompts]
        data, rewards = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            scores = [reward(list(s.tokens)) for s in sequences]
            baseline = sum(scores) / len(scores)
            rewards += scores
            for sequence, score in zip(sequences, scores, strict=True):
                tokens = prompt + list(sequence.tokens)
                pad = [0.0] * (len(prompt) - 1)  # prompt positions: no advantage, so no gradient
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": types.TensorData(data=pad + list(sequence.logprobs), dtype="float32"),
                                    "advantages": types.TensorData(
                                        data=pad + [score - baseline] * len(sequence.tokens), dtype="float32")}))
        training.forward_backward(data, loss_fn=loss_fn)
        training.optim_step(types.AdamParams(learning_rate=lr)).result()
        means.append(sum(rewards) / len(rewards))
        log(f"iteration {iteration + 1}/{iterations}  reward {means[-1]:.3f}")
    service.close("success").result()  # ends the session: the service frees the adapter
    return means


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--loss-fn", default="importance_sampling", help="importance_sampling | ppo | cispo")
    args = parser.parse_args()
    main(os.environ.get("TINKER_BASE_URL"), os.environ.get("TINKER_API_KEY"), args.base_model,
         iterations=args.iterations, lr=args.lr, loss_fn=args.loss_fn)
