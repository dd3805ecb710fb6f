"""The `hyflow` command line: one entry point, one subcommand per job.

    hyflow train [overrides...]             RL training in one process (verl's key names)
    hyflow sft [overrides...]               supervised fine-tuning (chat template, assistant-only loss)
    hyflow config [overrides...]            resolved config with help text and the batch arithmetic
    hyflow init-model --preset tiny --out D  random-weight model + locally trained tokenizer
    hyflow data make TASK --out D            write a built-in task's train/test files
    hyflow data gsm8k|math --input F --out D convert public GSM8K / MATH files to hyflow's (verl's) schema
    hyflow export --ckpt RUN/global_step_N --out D   Hugging Face model directory from a checkpoint
    hyflow plot RUN_DIR                      PNG curves (reward, validation, length, KL, entropy, timing)

Overrides use Hydra's syntax (`key=value`, `+key=value`), with verl's key names.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _cmd_train(args: argparse.Namespace) -> int:
    from hyflow.trainer.rl_trainer import run_rl

    history = run_rl(args.overrides, config_file=args.config)
    if history:
        last = history[-1]
        keys = [k for k in last if k.startswith(("val-core/", "critic/score/mean"))]
        print("final: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from hyflow.trainer.sft_trainer import run_sft

    history = run_sft(args.overrides, config_file=args.config)
    if history:
        print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in history[-1].items() if k.endswith("loss")))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from hyflow.config import describe_batch_arithmetic, load_config, render_config, validate_config

    cfg = load_config(args.overrides, config_file=args.config)
    print(render_config(cfg, with_help=not args.no_help))
    validate_config(cfg)
    print()
    print(describe_batch_arithmetic(cfg))
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from hyflow.models.tiny import make_tiny_model

    out = make_tiny_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote a random-weight {args.preset!r} model and its tokenizer to {out}")
    return 0


def _parse_task_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"task option {text!r} must look like key=value")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


def _cmd_data_make(args: argparse.Namespace) -> int:
    from hyflow.data.tasks import make_task

    opts = dict(args.option or [])
    paths = make_task(args.task, args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                      fmt=args.format, **opts)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _cmd_data_preprocess(args: argparse.Namespace) -> int:
    from hyflow.data import preprocess

    fn = {"gsm8k": preprocess.preprocess_gsm8k, "math": preprocess.preprocess_math}[args.dataset]
    print(fn(args.input, args.out, split=args.split))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from hyflow.trainer.plot import plot_run

    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from hyflow.trainer.export import export_checkpoint

    out = export_checkpoint(args.ckpt, args.out, component=args.component, base_model_path=args.base_model)
    print(f"wrote a Hugging Face model directory to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL training (PPO, GRPO, DAPO, RLOO, ...) from verl-style overrides")
    p.add_argument("overrides", nargs="*", help="e.g. algorithm.adv_estimator=grpo data.train_files=D/train.parquet")
    p.add_argument("--config", help="a YAML config file applied before the overrides")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("sft", help="supervised fine-tuning (verl's sft_trainer keys)")
    p.add_argument("overrides", nargs="*", help="e.g. data.train_files=D/train.parquet model.partial_pretrain=M")
    p.add_argument("--config", help="a YAML config file applied before the overrides")
    p.set_defaults(fn=_cmd_sft)

    p = sub.add_parser("config", help="print the resolved config with help text and the batch arithmetic")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. data.train_batch_size=32")
    p.add_argument("--config", help="a YAML config file applied before the overrides")
    p.add_argument("--no-help", action="store_true", help="omit the help comments")
    p.set_defaults(fn=_cmd_config)

    p = sub.add_parser("init-model", help="write a random-weight model and a locally trained tokenizer")
    p.add_argument("--preset", default="tiny", help="tiny | small | qwen2.5-0.5b-shape")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_cmd_init_model)

    p = sub.add_parser("plot", help="write PNG training curves from a run directory's metrics.jsonl")
    p.add_argument("run_dir", help="the run directory (trainer.default_local_dir)")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    p.set_defaults(fn=_cmd_plot)

    p = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint (full or sharded: "
                       "the shards every rank wrote are merged)")
    p.add_argument("--ckpt", required=True, help="a checkpoint directory, RUN_DIR/global_step_N")
    p.add_argument("--out", required=True, help="the new model directory")
    p.add_argument("--component", default=None, help="actor_model (RL; the default when present), model (SFT; "
                   "the default otherwise) or critic_model")
    p.add_argument("--base-model", default=None, help="model path for the architecture when the checkpoint "
                   "holds no config")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("data", help="make built-in task data or convert public datasets")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    m = data_sub.add_parser("make", help="write a built-in task's train/test files")
    m.add_argument("task", help="arithmetic | countdown | sorting")
    m.add_argument("--out", required=True)
    m.add_argument("--n-train", type=int, default=2000)
    m.add_argument("--n-test", type=int, default=200)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    m.add_argument("--option", action="append", type=_parse_task_option, metavar="KEY=VALUE",
                   help="task option, e.g. --option digits=2 (repeatable)")
    m.set_defaults(fn=_cmd_data_make)
    for name in ("gsm8k", "math"):
        d = data_sub.add_parser(name, help=f"convert a local {name.upper()} JSONL/parquet file")
        d.add_argument("--input", required=True)
        d.add_argument("--out", required=True)
        d.add_argument("--split", default=None, help="train | test (default: guessed from the file name)")
        d.set_defaults(fn=_cmd_data_preprocess, dataset=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, KeyError, FileNotFoundError, TypeError, RuntimeError) as exc:
        if getattr(args, "traceback", False):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hyflow {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
