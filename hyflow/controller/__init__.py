"""Control layer: worker base class, dispatch decorators, worker groups, executors. Knows no RL."""
