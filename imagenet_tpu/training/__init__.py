"""Training machinery around model.fit: checkpoints, resume and preemption, and the run's callbacks."""
