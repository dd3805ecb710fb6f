"""hyflow: reinforcement-learning post-training for large language models.

One driver process owns the dataflow (generate -> reward -> log-probs -> advantages -> update); workers own
the models. The same code runs in one plain Python process or on a Ray cluster. See DESIGN.md for the map.
"""

__version__ = "0.1.0"

__all__ = ["RLTrainer", "SFTTrainer", "load_config"]


def __getattr__(name: str):
    # Lazy: `import hyflow` stays cheap; the trainers pull in torch and transformers on first use.
    if name == "RLTrainer":
        from hyflow.trainer.rl_trainer import RLTrainer

        return RLTrainer
    if name == "SFTTrainer":
        from hyflow.trainer.sft_trainer import SFTTrainer

        return SFTTrainer
    if name == "load_config":
        from hyflow.config import load_config

        return load_config
    raise AttributeError(f"module 'hyflow' has no attribute {name!r}")
