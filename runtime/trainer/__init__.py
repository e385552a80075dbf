"""The RL trainer: workers (actor, ref, critic), the core, mode drivers, replay buffer, checkpoints."""
