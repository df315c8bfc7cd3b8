"""The pipeline runner: stages on their own ranks, micro-batches under a GPipe or 1F1B
schedule, point-to-point boundary traffic through the comm scheduler (`pp` class)."""
