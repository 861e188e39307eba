"""Configuration: composing a stage's Hydra config once, its schema, and the params.yaml writer."""
