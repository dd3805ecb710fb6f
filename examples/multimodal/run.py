"""hyflow vision-language demo: a tiny Qwen2-VL model learns to name the colour in a picture, by SFT then GRPO, on CPU.

    make demo-vl        (or: .venv/bin/python examples/multimodal/run.py [--out DIR])

1. A random 0.8M-parameter Qwen2-VL-shaped model (a 2-block vision tower under the tiny text model; OUT/init_model)
   with a locally trained tokenizer and image processor (no download). The built-in shapes task draws 2,000
   training and 100 held-out pictures of 1-4 shapes in one of four colours and asks "What colour is the shape?":
   the answer is only in the image. Its SFT demonstrations are imperfect on purpose: half of them say "It is red."
   instead of the `#### red` line the checker reads (`answer_line_rate=0.5`), the format drift of a real SFT set.
2. SFT (sft.yaml) on the pictures and the demonstrations: the model learns to see the colour, and writes the answer
   line about half of the time.
3. GRPO (grpo.yaml) on the same prompts with the checker's 0/1 score as the only reward; the hf engine samples with
   the pictures, the trainer recomputes the log-probs with them.
4. The last checkpoint is exported as a Hugging Face directory, OUT/model (with its image processor).
5. The summary reports greedy accuracy on the 100 held-out pictures after SFT and after RL and how often the answer
   line is written (from OUT/summary.json), then loads OUT/model with plain transformers and answers a picture
   drawn on the spot; the lines that do it are printed last.

What RL fixes here is mostly the answer format the checker demands (the colour itself SFT already sees): the
answer-line rate is printed next to the accuracy so the gain can be read for what it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION = "What colour is the shape? Put the final answer after '####'."
TRY_IT = "  try the RL-trained model with transformers:"


def answer_line_rate(generations: Path) -> float:
    rows = [json.loads(line) for line in generations.read_text().splitlines() if line.strip()]
    return sum("####" in row["output"] for row in rows) / max(len(rows), 1)


def accuracy(row: dict) -> float:
    return next(v for k, v in row.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1"))


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def transformers_lines(model: Path) -> list[str]:
    """Python lines that load the exported model with plain transformers (no torchvision needed), draw a blue square,
    expand the image's pad token as the processor would, and decode greedily."""
    path = json.dumps(str(model))
    return [
        "from PIL import Image",
        "from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer",
        f"path = {path}",
        "tok, pixels_of = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)",
        "model = AutoModelForImageTextToText.from_pretrained(path)",
        "image = Image.new(\"RGB\", (56, 56), \"white\"); image.paste((40, 80, 220), (8, 8, 40, 40))  # a blue square",
        "pixels = pixels_of(images=[image], return_tensors=\"pt\")",
        f"text = tok.apply_chat_template([{{\"role\": \"user\", \"content\": [{{\"type\": \"image\"}}, "
        f"{{\"type\": \"text\", \"text\": {json.dumps(QUESTION)}}}]}}], add_generation_prompt=True, tokenize=False)",
        "# one <|image_pad|> per 2x2 patches (AutoProcessor does this where torchvision is installed)",
        "text = text.replace(\"<|image_pad|>\", \"<|image_pad|>\" * int(pixels[\"image_grid_thw\"].prod() // 4))",
        "ids = tok(text, return_tensors=\"pt\")[\"input_ids\"]",
        "out = model.generate(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **pixels, "
        "max_new_tokens=8, do_sample=False)",
        "print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))",
    ]


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def provenance(load_before: list[float] | None) -> dict:
    """The run's command, date, load and machine (benchmarks/machine.py's `run_provenance`), for
    `tools/gen_figures.py`; only the load when the example was copied out of the repository."""
    import sys

    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    try:
        from machine import run_provenance
    except ImportError:
        return {"load_average_before": load_before, "load_average_after": load_average()}
    finally:
        sys.path.pop(0)
    return run_provenance(load_before)


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/multimodal", help="output folder (replaced)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's total_training_steps")
    parser.add_argument("--rl-steps", type=int, default=None, help="override grpo.yaml's total_training_steps")
    parser.add_argument("--n-test", type=int, default=100, help="held-out pictures the accuracy is measured "
                        "on (default 100; fewer: a quicker, noisier summary)")
    args = parser.parse_args()
    load_before = load_average()

    from transformers.utils import logging as transformers_logging

    from hyflow import RLTrainer, SFTTrainer, load_config
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.plot import plot_run

    transformers_logging.disable_progress_bar()  # transformers' own bars would interleave with the story

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    print("== 1/5 a random tiny vision-language model and the shapes task's pictures")
    init_model = make_tiny_model(out / "init_model", preset="tiny-vl", seed=0)
    make_task("shapes", out / "data", n_train=2000, n_test=args.n_test, seed=0, answer_line_rate=0.5)

    print("\n== 2/5 SFT warm start on the pictures, with imperfect demonstrations (sft.yaml)")
    sft_overrides = [f"model.partial_pretrain={init_model}", f"data.train_files={out}/data/train.parquet",
                     f"trainer.default_local_dir={out}/sft"]
    if args.sft_steps:
        sft_overrides.append(f"trainer.total_training_steps={args.sft_steps}")
    sft_history = SFTTrainer(load_sft_config(sft_overrides, HERE / "sft.yaml")).fit()
    sft_model = export_checkpoint(out / "sft" / f"global_step_{sft_history[-1]['step']}", out / "sft_model")

    print("\n== 3/5 GRPO with the checker's 0/1 score as the only reward (grpo.yaml)")
    rl_overrides = [f"actor_rollout_ref.model.path={sft_model}", f"data.train_files={out}/data/train.parquet",
                    f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/grpo"]
    if args.rl_steps:
        rl_overrides.append(f"trainer.total_training_steps={args.rl_steps}")
    rl_steps = load_config(rl_overrides, config_file=HERE / "grpo.yaml").trainer.total_training_steps
    rl_overrides.append(f"trainer.save_freq={rl_steps}")  # a checkpoint at the last step, exported in stage 4
    history = RLTrainer(load_config(rl_overrides, config_file=HERE / "grpo.yaml")).fit()
    before, after = history[0], history[-1]

    print(f"\n== 4/5 export the RL-trained model (checkpoint of step {after['step']}) as a Hugging Face directory")
    model = export_checkpoint(out / "grpo" / f"global_step_{after['step']}", out / "model")
    print(f"  -> {model}")

    print("\n== 5/5 plots and summary")
    plots = plot_run(out / "grpo", out_dir=out / "plots")
    gens = out / "grpo" / "generations"
    summary = {
        "accuracy_after_sft": accuracy(before),
        "accuracy_after_rl": accuracy(after),
        "answer_line_rate_after_sft": answer_line_rate(gens / "val_step_0.jsonl"),
        "answer_line_rate_after_rl": answer_line_rate(gens / f"val_step_{after['step']}.jsonl"),
        "sft_steps": sft_history[-1]["step"],
        "rl_steps": after["step"],
        "model": str(model),
        "wall_time_s": round(time.perf_counter() - start, 1),
        **provenance(load_before),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    code = transformers_lines(model)
    namespace: dict = {}
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as printed:  # the printed lines, run here on a fresh picture
        exec(compile("\n".join(code), "<the lines below>", "exec"), namespace)
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    print()
    print(f"hyflow vision-language demo: summary (greedy decoding, {args.n_test} held-out pictures)")
    print(f"  accuracy after SFT ({summary['sft_steps']} steps): {100 * summary['accuracy_after_sft']:5.1f}%   "
          f"answer line written: {100 * summary['answer_line_rate_after_sft']:5.1f}%")
    print(f"  accuracy after GRPO ({summary['rl_steps']} steps): {100 * summary['accuracy_after_rl']:5.1f}%   "
          f"answer line written: {100 * summary['answer_line_rate_after_rl']:5.1f}%")
    print(f"  gain from RL: {gain:+.1f} points")
    print(f"  wall time: {minutes(summary['wall_time_s'])} (this machine, at its current load)")
    print(f"  plot: {plots[0]}   run directories: {out}/sft, {out}/grpo   summary: {out}/summary.json")
    print(f"  RL-trained model (Hugging Face format, with its image processor): {model}")
    print(f"  asked about a blue square drawn just now, it answers: {printed.getvalue().strip()!r}")
    print()
    print(TRY_IT)
    for line in code:
        print(f"    {line}")


if __name__ == "__main__":
    main()
