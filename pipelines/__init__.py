"""Hydra + MLflow entry points around the `slackswap` library (which imports neither)."""
