"""Run logs: JSONL metrics and emergence files, the console, wandb, status."""
