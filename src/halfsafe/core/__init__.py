"""The pure part: sites and hooks, activation statistics, groups, the probe, the plan, the one rewrite, margins,
metrics, float formats and one forward pass for every model kind. Nothing here reads or writes files, and nothing
here imports halfsafe.engine: a model's weights are reached through `weights.Weights`, behind which the engine
plugs in its streamed model (tests/test_layout.py checks both)."""
