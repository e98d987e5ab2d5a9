#!/usr/bin/env python
"""Probe time on the Gemma 3 270M fixture: the model itself (streamed block by block, as convert loads it)
against a shrunk random copy (halfsafe.core.shrink), and whether the two agree on every constraint the planner uses
(entries with a non-zero power).

    PYTHONPATH=src .venv/bin/python bench/cost/probe_shrink.py
"""

from __future__ import annotations

import time

from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import PROBE_TOKENS
from halfsafe.core.forward import prefix
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.shrink import probe_governed, shrunk_model
from halfsafe.families import family_for
from halfsafe.io.loading import load_model

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)


def main() -> None:
    loaded = load_model("gemma3-270m", stream=True)
    model = loaded.model
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    ids = prefix(make_samples([default_text()], loaded.tokenizer, model.config.get_text_config().vocab_size, 512, 1)[0], PROBE_TOKENS)
    t = time.perf_counter()
    real = probe(model, family, groups, ids)
    t_real = time.perf_counter() - t
    t = time.perf_counter()
    small = shrunk_model(model, groups)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    mapped = probe_governed(model, family, groups, ids)
    t_shrunk = time.perf_counter() - t
    settled = lambda g: {n: {s: p for s, p in sites.items() if p} for n, sites in g.items()}  # noqa: E731
    same = settled(real) == settled(mapped)
    print(f"real model probe (streamed): {t_real:.1f} s")
    print(f"shrunk probe (build {t_build:.1f} s, {small.config.get_text_config().num_hidden_layers} blocks, "
          f"{sum(p.numel() for p in small.parameters()) / 1e6:.1f} M params), total: {t_shrunk:.1f} s")
    print(f"non-zero governed powers identical: {same}")
    if not same:
        a, b = settled(real), settled(mapped)
        for g in a:
            if a[g] != b.get(g):
                print(g, {s: p for s, p in a[g].items() if b[g].get(s) != p}, {s: p for s, p in b[g].items() if a[g].get(s) != p})


if __name__ == "__main__":
    main()
