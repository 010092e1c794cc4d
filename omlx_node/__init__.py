"""Node side: agent, stage runner, batcher, metrics. The only code that runs MLX models."""
