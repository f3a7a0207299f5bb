"""mlx-router: the HTTP front end. Never imports mlx or mlx_lm."""
