"""The experiment run.py runs: its config schema and checks (config), prompts (data), the Lightning module that
decodes and counts (module), the per-prompt files (records), the statistics (metrics) and what W&B and the console
show (logging)."""
