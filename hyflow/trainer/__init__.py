"""RL and SFT trainers (the dataflow), validation, checkpoints, tracking."""
