"""mlx-worker: the one process that owns the model and the Metal memory."""
