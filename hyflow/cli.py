"""The `hyflow` command line: one entry point, one subcommand per job.

    hyflow train [overrides...]             RL training in one process (verl's key names)
    hyflow sft [overrides...]               supervised fine-tuning (chat template, assistant-only loss)
    hyflow dpo [overrides...]               offline preference optimisation (DPO, IPO, CPO, SimPO, ORPO, KTO)
    hyflow config [overrides...]            resolved config with help text and the batch arithmetic
    hyflow init-model --preset tiny --out D  random-weight model + locally trained tokenizer
    hyflow data make TASK --out D            write a built-in task's train/test files
    hyflow data gsm8k|math --input F --out D convert public GSM8K / MATH files to hyflow's (verl's) schema
    hyflow data geo3k --input F_OR_DIR --out D  convert Geometry3K (images + text, verl's multimodal rows)
    hyflow data reasoning-gym --task T --out D  generate Reasoning Gym's procedural tasks (hyflow[envs])
    hyflow data textarena --env E --out D       single-player TextArena games for env_agent (hyflow[envs])
    hyflow data verifiers --env E --out D       a verifiers environment for verifiers_agent (hyflow[envs])
    hyflow export --ckpt RUN/global_step_N --out D   Hugging Face model directory from a checkpoint
    hyflow plot RUN_DIR                      PNG training curves of an RL or SFT run (smoothed, titled)

Overrides use Hydra's syntax (`key=value`, `+key=value`), with verl's key names (0.10's and the legacy ones).
`--config-path DIR --config-name NAME` (Hydra's flags, as verl's scripts use them) or `--config FILE` load a YAML
file first.

A problem you can fix (a config key, a missing or unreadable file, a reward file that does not import, a Ray
cluster that cannot be reached) ends with one line `hyflow CMD: error: ...` and exit status 2; anything else
with one line, the hint to run again with `--traceback`, and exit status 1. `--traceback` (before or after the
subcommand) shows the full stack instead.
"""

from __future__ import annotations

import argparse
import errno
import json
import linecache
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command line's overrides after what Hydra flags naming one of verl's own trainer configs mean
    (`model_engine=megatron` for ppo_megatron_trainer; nothing for ppo_trainer)."""
    from hyflow.config.loader import verl_config_overrides

    return [*(verl_config_overrides(args.config_path, args.config_name) or []), *args.overrides]


def _config_file(args: argparse.Namespace) -> str | Path | None:
    """`--config FILE`, or the file Hydra's `--config-path/--config-name` name (not both)."""
    from hyflow.config.keys import ConfigError
    from hyflow.config.loader import config_file_from_hydra_flags

    hydra = config_file_from_hydra_flags(args.config_path, args.config_name)
    if hydra is not None and args.config is not None:
        raise ConfigError("give either --config FILE or --config-path/--config-name, not both.")
    return hydra if hydra is not None else args.config


def _cmd_train(args: argparse.Namespace) -> int:
    from hyflow.trainer.rl_trainer import run_rl

    history = run_rl(_overrides(args), config_file=_config_file(args))
    if history:
        last = history[-1]
        keys = [k for k in last if k.startswith(("val-core/", "critic/score/mean"))]
        print("final: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from hyflow.trainer.sft_trainer import run_sft

    history = run_sft(_overrides(args), config_file=_config_file(args))
    if history:
        print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in history[-1].items() if k.endswith("loss")))
    return 0


def _cmd_dpo(args: argparse.Namespace) -> int:
    from hyflow.trainer.dpo_trainer import run_dpo

    history = run_dpo(_overrides(args), config_file=_config_file(args))
    if history:
        keys = ("train/loss", "rewards/accuracies", "rewards/margins", "val/loss", "val/rewards/accuracies")
        print("final: " + ", ".join(f"{k}={history[-1][k]:.4g}" for k in keys if k in history[-1]))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from hyflow.config import describe_batch_arithmetic, load_config, render_config, validate_config
    from hyflow.config.support import engine_line, performance_only_warning

    cfg = load_config(_overrides(args), config_file=_config_file(args))
    print(render_config(cfg, with_help=not args.no_help, section=args.section))
    validate_config(cfg)
    if args.section:  # one section only: the batch arithmetic is the whole config's
        return 0
    print()
    print(describe_batch_arithmetic(cfg))
    if (accepted := performance_only_warning(cfg)) is not None:
        print()
        print(accepted)
    if (engine := engine_line(cfg)) is not None:
        print()
        print(engine)
    print()
    print(_role_specs_text(cfg))
    return 0


def _role_specs_text(cfg) -> str:
    """The role specs of `cfg` in words (`describe_role_specs`): the reward model's too when it is on."""
    from hyflow.config.describe import describe_role_specs
    from hyflow.config.roles import reward_model_spec, role_specs

    steps = cfg.trainer.total_training_steps
    more = {"reward_model": reward_model_spec(cfg)} if cfg.reward_model.enable else {}
    return describe_role_specs(role_specs(cfg, total_steps=steps or 1), total_steps_known=steps is not None, **more)


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


def _generate_library_data(args: argparse.Namespace, chosen: str | None, usage: str, names, write) -> int:
    """`hyflow data reasoning-gym|textarena`: --list prints `names()`; else `write(chosen, out, sizes, options)`."""
    if args.list:
        print("\n".join(names()))
        return 0
    if not chosen or not args.out:
        raise ValueError(usage)
    paths = write(chosen, args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                  options=dict(args.option or []), fmt=args.format)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _cmd_data_reasoning_gym(args: argparse.Namespace) -> int:
    from hyflow.data.reasoning_gym import task_names, write_reasoning_gym

    def write(tasks, out, options, **kwargs):
        return write_reasoning_gym(tasks, out, config=options, **kwargs)

    return _generate_library_data(args, args.task, "hyflow data reasoning-gym needs --task NAME[,NAME] and --out "
                                  "DIR (--list shows the tasks)", task_names, write)


def _cmd_data_textarena(args: argparse.Namespace) -> int:
    from functools import partial

    from hyflow.data.textarena import write_textarena
    from hyflow.rollout.textarena_env import game_ids, opening

    return _generate_library_data(args, args.env, "hyflow data textarena needs --env ID[,ID] and --out DIR (--list "
                                  "shows the games)", game_ids, partial(write_textarena, opening=opening))


def _cmd_data_verifiers(args: argparse.Namespace) -> int:
    import sys

    from hyflow.data.verifiers import write_verifiers
    from hyflow.rollout.verifiers_env import load_env

    if not args.env or not args.out:
        raise ValueError("hyflow data verifiers needs --env ID (an installed verifiers environment) and --out DIR")
    sys.path.insert(0, ".")  # an environment module in the current directory, as verifiers' own CLI finds it
    paths = write_verifiers(args.env, args.out, load_env=load_env, n_train=args.n_train, n_test=args.n_test,
                            seed=args.seed, options=dict(args.option or []), fmt=args.format)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _cmd_data_preprocess(args: argparse.Namespace) -> int:
    from hyflow.data import preprocess

    if args.dataset == "geo3k":
        for split, path in preprocess.preprocess_geo3k(args.input, args.out, split=args.split).items():
            print(f"{split}: {path}")
        return 0
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

    out = export_checkpoint(args.ckpt, args.out, component=args.component, base_model_path=args.base_model,
                            adapter=args.adapter)
    print(f"wrote {'a peft LoRA adapter' if args.adapter else 'a Hugging Face model'} directory to {out}")
    return 0


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML config file applied before the overrides")
    p.add_argument("--config-path", "-cp", dest="config_path", default=None,
                   help="Hydra's flag: the folder of --config-name (relative to the working directory)")
    p.add_argument("--config-name", "-cn", dest="config_name", default=None,
                   help="Hydra's flag: the YAML file (with or without .yaml) in --config-path; its `defaults:` "
                   "list may name other files of that folder and verl's base trainer configs")


def _add_traceback_flag(p: argparse.ArgumentParser, *, top: bool) -> None:
    # The subcommands' copies do not set a default, so `hyflow --traceback train` is not reset by `train`.
    p.add_argument("--traceback", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="on an error, show the full Python stack instead of one line")


def build_parser() -> argparse.ArgumentParser:
    from hyflow import __version__

    parser = argparse.ArgumentParser(prog="hyflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hyflow {__version__}")
    _add_traceback_flag(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_training_commands(sub)
    _add_model_commands(sub)
    _add_data_commands(sub)
    _add_serve_command(sub)
    for subparser in _subparsers(parser):
        _add_traceback_flag(subparser, top=False)
    return parser


def _add_training_commands(sub) -> None:
    """`hyflow train | sft | dpo | config`."""
    p = sub.add_parser("train", help="RL training (PPO, GRPO, DAPO, RLOO, ...) from verl-style overrides")
    p.add_argument("overrides", nargs="*", help="e.g. algorithm.adv_estimator=grpo data.train_files=D/train.parquet")
    _add_config_flags(p)
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("sft", help="supervised fine-tuning (verl's sft_trainer keys)")
    p.add_argument("overrides", nargs="*", help="e.g. data.train_files=D/train.parquet model.path=M")
    _add_config_flags(p)
    p.set_defaults(fn=_cmd_sft)

    p = sub.add_parser("dpo", help="offline preference optimisation: DPO, IPO, hinge, CPO, SimPO, ORPO, KTO (TRL's "
                       "algorithm keys)")
    p.add_argument("overrides", nargs="*", help="e.g. data.train_files=D/train.parquet model.partial_pretrain=M "
                   "algorithm.loss_type=sigmoid algorithm.beta=0.1")
    _add_config_flags(p)
    p.set_defaults(fn=_cmd_dpo)

    p = sub.add_parser("config", help="print the resolved config with help text and the batch arithmetic")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. data.train_batch_size=32")
    _add_config_flags(p)
    p.add_argument("--no-help", action="store_true", help="omit the help comments")
    p.add_argument("--section", "-s", metavar="KEY", default=None,
                   help="print only this section or key, e.g. --section actor_rollout_ref.actor")
    p.set_defaults(fn=_cmd_config)


def _add_serve_command(sub) -> None:
    """`hyflow serve`: the Tinker-compatible service (hyflow.serve, docs/serve.md)."""
    what = ("a Tinker-compatible training and sampling service: LoRA adapters per client on one base model (the "
            "tinker SDK's REST API; docs/serve.md)")
    p = sub.add_parser("serve", help=what, description=what)
    p.add_argument("--model", required=True, help="the base model: a local Hugging Face directory (or hub id)")
    p.add_argument("--name", default=None, help="the base_model name clients ask for (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--allow-remote", action="store_true", help="needed with a --host other machines can reach")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send (tml-...; repeat for several; each key sees only its own runs "
                   "and checkpoints); default: one generated and printed at start")
    p.add_argument("--store", default=None, help="checkpoint folder (default ~/.cache/hyflow/serve)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (with --workers: cpu or cuda, a device each)")
    p.add_argument("--workers", type=int, default=1, help="replicas of the model on Ray workers (data parallel: "
                   "each call's data split over them, gradients summed); 1 = in this process")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs each replica reserves (--workers)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (the base model's weights)")
    p.add_argument("--max-pending", type=int, default=256, help="calls queued at most (429 past it)")
    p.add_argument("--max-runs", type=int, default=64, help="training runs (LoRA adapters) held at once (429 past "
                   "it); a run is unloaded when its client's session ends (no heartbeat for --session-ttl-s)")
    p.add_argument("--session-ttl-s", type=float, default=300.0, help="a session without a heartbeat for this long "
                   "ends and its runs are unloaded (the SDK beats every 10 s; checkpoints stay)")
    p.add_argument("--max-body-mb", type=int, default=64, help="largest request body in MiB (413 past it)")
    p.add_argument("--max-batch-samples", type=int, default=256, help="sample calls queued together on the same "
                   "weights decode as one batch of at most this many samples (1: one call at a time)")
    p.set_defaults(fn=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import tinker  # noqa: F401  (the protocol's types and protobuf messages)
    except ImportError as exc:
        raise ValueError("hyflow serve speaks the tinker SDK's protocol and needs its package: pip install "
                         "'hyflow[serve]' (tinker==0.38.0)") from exc
    from hyflow.serve import serve

    return serve(args)


def _add_model_commands(sub) -> None:
    """`hyflow init-model | plot | export`."""
    p = sub.add_parser("init-model", help="write a random-weight model and a locally trained tokenizer")
    p.add_argument("--preset", default="tiny", help="tiny | small | qwen2.5-0.5b-shape | tiny-vl (Qwen2-VL) | "
                   "tiny-vl-2.5 (Qwen2.5-VL)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_cmd_init_model)

    p = sub.add_parser("plot", help="write PNG training curves (RL or SFT) from RUN_DIR/metrics.jsonl")
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
                   "holds no config, and the base a LoRA adapter is merged into (default: the run's model path)")
    p.add_argument("--adapter", action="store_true", help="LoRA runs: write the bare adapter (peft directory) "
                   "instead of the merged model")
    p.set_defaults(fn=_cmd_export)


def _add_data_commands(sub) -> None:
    """`hyflow data make | reasoning-gym | textarena | verifiers | gsm8k | math | geo3k`."""
    p = sub.add_parser("data", help="make built-in task data or convert public datasets")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    m = data_sub.add_parser("make", help="write a built-in task's train/test files")
    m.add_argument("task", help="arithmetic | calculator | countdown | shapes | sorting")
    m.add_argument("--out", required=True)
    _add_generation_args(m, "task option, e.g. --option digits=2 (repeatable)")
    m.set_defaults(fn=_cmd_data_make)
    r = data_sub.add_parser("reasoning-gym", help="generate Reasoning Gym tasks (procedural, verifiable; "
                            "hyflow[envs])")
    r.add_argument("--task", default=None, help="task name(s), comma-separated (e.g. leg_counting,chain_sum)")
    r.add_argument("--out", default=None)
    _add_generation_args(r, "a generator option, e.g. --option min_animals=2 (repeatable)")
    r.add_argument("--list", action="store_true", help="print the task names and exit")
    r.set_defaults(fn=_cmd_data_reasoning_gym)
    t = data_sub.add_parser("textarena", help="single-player TextArena games for the env_agent loop (hyflow[envs])")
    t.add_argument("--env", default=None, help="game id(s), comma-separated (e.g. GuessTheNumber-v0)")
    t.add_argument("--out", default=None)
    _add_generation_args(t, "a game option, e.g. --option max_turns=10 (repeatable)")
    t.add_argument("--list", action="store_true", help="print the game ids and exit")
    t.set_defaults(fn=_cmd_data_textarena)
    v = data_sub.add_parser("verifiers", help="a verifiers environment's dataset for the verifiers_agent loop "
                            "(hyflow[envs])")
    v.add_argument("--env", default=None, help="the environment's id (an installed package or a module on the path)")
    v.add_argument("--out", default=None)
    _add_generation_args(v, "an option of the environment's load_environment, e.g. --option num_examples=100 "
                         "(repeatable)")
    v.set_defaults(fn=_cmd_data_verifiers)
    for name in ("gsm8k", "math"):
        d = data_sub.add_parser(name, help=f"convert a local {name.upper()} JSONL/parquet file")
        d.add_argument("--input", required=True)
        d.add_argument("--out", required=True)
        d.add_argument("--split", default=None, help="train | test (default: guessed from the file name)")
        d.set_defaults(fn=_cmd_data_preprocess, dataset=name)
    g = data_sub.add_parser("geo3k", help="convert a local Geometry3K copy (hiyouga/geometry3k: its folder or a "
                            "parquet file) to verl's multimodal rows, as verl's geo3k.py")
    g.add_argument("--input", required=True, help="the dataset's folder (data/train-*.parquet, data/test-*.parquet) "
                   "or one parquet file")
    g.add_argument("--out", required=True)
    g.add_argument("--split", default=None, help="train | test (a file: default guessed from its name; a folder: "
                   "only that split, default both)")
    g.set_defaults(fn=_cmd_data_preprocess, dataset="geo3k")


def _add_generation_args(parser: argparse.ArgumentParser, option_help: str) -> None:
    """The options of the commands that generate task data: sizes, seed, file format, generator options."""
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    parser.add_argument("--option", action="append", type=_parse_task_option, metavar="KEY=VALUE", help=option_help)


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


# ------------------------------------------------------------------------------------------- errors

# OSError numbers that a user fixes (a path, a permission, a full disk), not a bug.
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ECONNREFUSED, errno.EHOSTUNREACH,
                errno.ETIMEDOUT, errno.ENOTEMPTY}
_OS_HINTS = {
    errno.EACCES: "the path is not writable or readable for you; fix its permissions or choose another path; "
                  "for a run, trainer.default_local_dir",
    errno.EPERM: "the operation is not permitted on this path; choose another path",
    errno.EROFS: "the file system is read-only; choose a writable path; for a run, "
                 "trainer.default_local_dir",
    errno.ENOTDIR: "a file is in the way where a directory is needed; remove it or choose another path; "
                   "for a run, trainer.default_local_dir",
    errno.EEXIST: "a file is in the way where a directory is needed; remove it or choose another path; "
                  "for a run, trainer.default_local_dir",
    errno.EISDIR: "a directory was given where a file is needed",
    errno.ENOSPC: "free space on that device or write somewhere else",
    errno.EDQUOT: "the disk quota is exhausted; free space or write somewhere else",
    errno.ECONNREFUSED: "nothing listens at that address; start the service (for Ray: ray start --head) or fix "
                        "ray_kwargs.address",
}


def _ray_error(exc: BaseException) -> bool:
    """An error of the Ray cluster itself (a dead raylet or node, a lost connection): the user restarts it."""
    module = type(exc).__module__ or ""
    return module.startswith("ray.") and type(exc).__name__ in {
        "RaySystemError", "RayActorError", "ActorDiedError", "NodeDiedError", "ActorUnavailableError",
        "GetTimeoutError", "RayChannelError", "ObjectLostError", "OwnerDiedError", "LocalRayletDiedError",
        "WorkerCrashedError", "OutOfMemoryError", "RuntimeEnvSetupError", "ActorPlacementGroupRemoved"}


def _raised_on_purpose(exc: BaseException) -> bool:
    """Whether hyflow raised `exc` itself with a `raise` statement (a checked problem with a message), rather
    than Python, torch or a library failing inside it (a bug)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    package = str(Path(__file__).resolve().parent)
    if not str(Path(filename).resolve()).startswith(package):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


def _user_error(exc: BaseException) -> str | None:
    """The one-line message for an error the user can fix, or None for anything else."""
    from hyflow.config.keys import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in _USER_ERRNOS:
        where = f": {exc.filename!r}" if exc.filename is not None else ""
        other = f" -> {exc.filename2!r}" if getattr(exc, "filename2", None) else ""
        hint = _OS_HINTS.get(exc.errno)
        return f"{exc.strerror or exc}{where}{other}" + (f" ({hint})" if hint else "")
    if isinstance(exc, OSError) and exc.errno is None and _raised_on_purpose(exc):
        return str(exc)  # FileNotFoundError("custom reward file ... not found") and the like
    if _ray_error(exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"the Ray cluster failed ({type(exc).__name__}: {first}); check it with `ray status`, restart it "
                "(ray stop; ray start --head) or leave ray_kwargs.address unset to start a local one")
    if isinstance(exc, (ValueError, TypeError, KeyError, AttributeError, ImportError, RuntimeError, LookupError,
                        NotImplementedError, TimeoutError)) and _raised_on_purpose(exc):
        return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    if isinstance(exc, SyntaxError):
        return f"{exc.msg} in {exc.filename}, line {exc.lineno}"
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; overrides may come before, between and after the flags, as Hydra allows
    (`hyflow train --config-path D a=1 --config-name N b=2`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and not any(word.startswith("-") for word in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            chosen = _chosen_parser(parser, list(sys.argv[1:] if argv is None else argv))
            hints = [hint for word in extra if word.startswith("-") and (hint := _option_hint(chosen, word))]
            chosen.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"; {hint}" for hint in hints))
    return args


def _chosen_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser that `argv` selects (`hyflow data make ...`: the `data make` one)."""
    for word in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if actions and word in actions[0].choices:
            parser = actions[0].choices[word]
    return parser


def _option_hint(parser: argparse.ArgumentParser, word: str) -> str | None:
    """'did you mean --x?' for an unknown option `word` of `parser` (the closest of its options), or how to write
    a config override when `word` is one written as an option (`--data.train_files=F`)."""
    import difflib

    name = word.split("=", 1)[0]
    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    if "." in name and any(action.dest == "overrides" for action in parser._actions):
        return f"a config override is written without dashes: {word.lstrip('-')}"
    return f"the options of '{parser.prog}' are {', '.join(sorted(options))}" if options else None


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, Kubernetes and `kill` send before they kill), raised where the main thread is: the run
    ends as on Ctrl-C (its services stopped, one line saying where it stands and how to resume), exit status 143."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        return args.fn(args)
    except KeyboardInterrupt as interrupt:
        if args.traceback:
            raise
        where = f" {interrupt}" if str(interrupt) else ""  # the trainer says where the run stands
        how, status = ("terminated (SIGTERM)", 143) if isinstance(interrupt, Terminated) else ("interrupted", 130)
        print(f"hyflow {args.command}: {how}{where}", file=sys.stderr, flush=True)
        return status
    except Exception as exc:
        if args.traceback:
            raise
        message = _user_error(exc)
        if message is not None:
            print(f"hyflow {args.command}: error: {_tidy(message)}", file=sys.stderr)
            return 2
        text = _tidy(str(exc)) or "(no message)"
        print(f"hyflow {args.command}: error: {type(exc).__name__}: {text} "
              "(an unexpected error, maybe a bug in hyflow: run again with --traceback to see where)",
              file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _tidy(message: str) -> str:
    """Multi-line messages (a list of problems) stay readable; a single trailing newline is dropped."""
    return str(message).rstrip()


if __name__ == "__main__":
    sys.exit(main())
