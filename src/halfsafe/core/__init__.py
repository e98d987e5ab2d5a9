"""The pure part: sites and hooks, activation statistics, groups, the probe, the plan, the one rewrite, margins,
metrics and float formats. Nothing here reads or writes files."""
