"""The tool demo's SFT warm start (sft.yaml on the calculator task's conversations), shared by `make demo-tools`
(examples/tools/run.py) and `make demo-openai` (examples/openai_agent/run.py)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def sft_warm_start(out: Path, sft_model: str | None = None, sft_steps: int | None = None) -> tuple[Path, int | None]:
    """(the SFT model's Hugging Face directory, its SFT steps): `sft_model` reused as it is (steps None), or a
    random tiny model (seed 0, OUT/init_model) trained by sft.yaml on OUT/data (`sft_steps` overrides its
    length) and exported to OUT/sft_model."""
    if sft_model:
        print(f"  reused from {sft_model}")
        return Path(sft_model), None
    from hyflow import SFTTrainer
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint

    init_model = make_tiny_model(out / "init_model", preset="tiny", seed=0)
    overrides = [f"model.partial_pretrain={init_model}", f"data.train_files={out}/data/train.parquet",
                 f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/sft"]
    if sft_steps:
        overrides.append(f"trainer.total_training_steps={sft_steps}")
    history = SFTTrainer(load_sft_config(overrides, HERE / "sft.yaml")).fit()
    steps = history[-1]["step"]
    return export_checkpoint(out / "sft" / f"global_step_{steps}", out / "sft_model"), steps
