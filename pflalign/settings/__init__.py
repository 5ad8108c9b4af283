"""Declarations: config keys (options), typed hyperparameters (params) and the run's settings
schema."""
