"""Worker roles (actor, critic, ref, reward model) and the training engine."""
