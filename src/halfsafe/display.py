"""Rich tables for the terminal.

Top level: beside the CLI, the only module that shows them.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .convert import ConversionReport
from .core.formats import FormatInfo
from .core.sites import headroom_bits
from .core.stats import PERCENTILE
from .scan import ScanReport


def _plain(title: str) -> Text:
    """A table title that holds a user's path or file name, shown as it is (no Rich markup or emoji codes read)."""
    return Text(title, style="table.title")


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 or x != x else f"{x:.3e}"


def headroom_cell(bits: float) -> str:
    color = "red" if bits < 0 else "yellow" if bits < 2 else "green"
    return f"[{color}]{bits:+.2f}[/]"


def scan_tables(report: ScanReport, console: Console, top: int = 12) -> None:
    layers = Table(title=_plain(f"Residual stream per layer: {report.model}"), title_justify="left")
    for col in ("layer", "residual |x| max", "headroom bits", "largest inside", "at"):
        layers.add_column(col, justify="right" if col != "at" and col != "layer" else "left")
    for l in report.layers:
        layers.add_row(l.name, fmt(l.residual_peak), headroom_cell(l.headroom_bits), fmt(l.inner_peak), l.inner_site)
    console.print(layers)

    worst = Table(title=f"Tightest {top} tensors (of {len(report.sites)} measured)", title_justify="left")
    for col in ("site", "class", "|x| max", f"p{PERCENTILE:g}", "> 65504", "subnormal frac", "headroom bits"):
        worst.add_column(col, justify="left" if col in ("site", "class") else "right")
    for s in report.worst(top):
        worst.add_row(s.name, s.module_class, fmt(s.abs_max), fmt(s.percentile), str(s.above_fp16_max),
                      f"{s.underflow_fraction:.2%}", headroom_cell(s.headroom_bits))
    console.print(worst)
    peak = report.peak
    verdict = "[green]fp16_safe: true[/]" if report.fp16_safe else "[red]fp16_safe: false[/]"
    console.print(f"{verdict}  peak {fmt(peak.abs_max)} at {peak.name} ({peak.headroom_bits:+.2f} bits) over "
                  f"{report.n_tokens} tokens in {report.n_samples} samples")
    if report.fp16_checked:
        where = report.first_nonfinite_fp16
        console.print(f"fp16 run: first non-finite output at [bold]{where}[/]" if where else "fp16 run: all outputs finite")
    if report.runtime is not None:
        runtime_table(report.runtime, console, top)


def runtime_table(rt, console: Console, top: int = 12) -> None:
    """scan --runtime: the quantities the profile holds in float16, tightest first (halfsafe.runtime.stats)."""
    t = Table(title=f"Runtime {rt.profile.name}: what it computes in float16, tightest {top}", title_justify="left")
    for col in ("site", "|x| max", "sum x^2 max", "mean x^2 max", "rows sum > 65504", "mean x^2 min",
                "rows mean -> 0", "eps -> 0", "partial sum max", "headroom bits"):
        t.add_column(col, justify="left" if col == "site" else "right", no_wrap=col == "site")
    for s in rt.tightest(top):
        if hasattr(s, "sum_sq_max"):
            t.add_row(s.name, fmt(s.dev_max), fmt(s.sum_sq_max), fmt(s.mean_sq_max),
                      f"{s.rows_sum_overflow}/{s.rows}", fmt(s.mean_sq_min), str(s.rows_mean_zero),
                      "yes" if s.eps_rounds_to_zero else "no", "-", headroom_cell(s.headroom_bits))
        else:
            t.add_row(s.name, "-", "-", "-", "-", "-", "-", "-", fmt(s.partial_max), headroom_cell(s.headroom_bits))
    console.print(t)
    verdict = "[green]fits[/]" if rt.fits else "[red]does not fit[/]"
    over = sum(s.rows_sum_overflow for s in rt.norms.values())
    rows = sum(s.rows for s in rt.norms.values())
    console.print(f"runtime {rt.profile.name}: {verdict}; norm rows whose sum of squares passes 65504: {over:,} of {rows:,}"
                  + (f"; linears whose partial sums pass 65504: {sum(s.partial_max > 65504 for s in rt.linears.values())}"
                     if rt.linears else ""))


def formats_table(formats: list[FormatInfo], console: Console) -> None:
    t = Table(title="Float formats")
    for col in ("format", "max finite", "min normal", "min subnormal", "mantissa bits", "spacing near 1"):
        t.add_column(col, justify="right" if col != "format" else "left")
    for f in formats:
        t.add_row(f.name, f"{f.max:.6g}", f"{f.min_normal:.3g}", f"{f.min_subnormal:.3g}", str(f.mantissa_bits), f"{f.spacing_near_one:.3g}")
    console.print(t)


def conversion_tables(report: ConversionReport, console: Console) -> None:
    plan = report.plan
    cands = Table(title=f"Candidate plans ({plan.family}), ranked by fp16 KL to fp32 on a calibration prefix", title_justify="left")
    for col in ("residual scale", "other groups moved", "headroom (bits)", "KL(fp32 || fp16)", "top-1 agreement", "finite", "chosen"):
        cands.add_column(col, justify="right")
    for c in report.candidates:
        others = sum(1 for k, v in c.exponents.items() if k != "residual" and v)
        res = c.exponents.get("residual")
        if not c.keeps_margin:
            cands.add_row(f"2^{res}" if res is not None else "-", str(others), f"{c.headroom_bits:.2f}", "not run: below the margin", "", "", "")
            continue
        cands.add_row(f"2^{res}" if res is not None else "-", str(others), f"{c.headroom_bits:.2f}", f"{c.kl:.3e}", f"{c.top1:.2%}",
                      "yes" if c.finite else "[red]no[/]", "[green]<-[/]" if report.is_chosen(c) else "")
    console.print(cands)
    if report.margin is not None:
        m = report.margin
        console.print(f"margin: {m.bits:.2f} bits under 65504, made for contexts up to {m.context_length} tokens "
                      f"(calibrated on samples of up to {m.calibrated_tokens} tokens; {m.rule})")
    layers = Table(title="Residual stream per layer, before and after (predicted from the plan)", title_justify="left")
    for col in ("layer", "before", "after", "headroom after (bits)"):
        layers.add_column(col, justify="right" if col != "layer" else "left")
    for before, (name, after) in zip(report.scan_before.layers, report.layers_after):
        layers.add_row(name, fmt(before.residual_peak), fmt(after), headroom_cell(headroom_bits(after)))
    console.print(layers)
    worst = max(report.storage, key=lambda s: s["after"]["fp16_rel_error"], default=None)
    eps = f"norm eps x 2^{plan.eps_exponent}" + "".join(f"; {k} x 2^{v}" for k, v in plan.eps_fields.items())
    console.print(f"{len(plan.tensors)} tensors rescaled; {eps}; fp32 output change "
                  f"{report.fp32_output_change:.2e} (exactness)")
    if worst is not None:
        console.print(f"largest fp16 storage error of a rescaled tensor: {worst['after']['fp16_rel_error']:.2e} ({worst['param']})")
    for site, v in report.tight[:5]:
        console.print(f"[yellow]below the headroom target:[/] {site} at {fmt(v)}")
    for site, v in report.unfixable[:10]:
        console.print(f"[red]still above 65504 (no exact rescaling reaches it):[/] {site} at {fmt(v)}")


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _opt(x, spec: str) -> str:
    if x is None:
        return "-"
    return "[red]nan[/]" if x != x else format(x, spec)


def verify_tables(report, console: Console) -> None:
    """`halfsafe verify`: one row per variant, overall; then one table per text when there are several."""
    texts = ", ".join(f"{t['name']} ({t['samples']} x <= {report.seq_len} tokens)" for t in report.texts)
    t = Table(title=_plain(f"{report.model} vs its float32 run on {texts}"), title_justify="left")
    for col in ("variant", "custom code", "non-finite logits", "KL to fp32 / token", "top-1", "perplexity",
                "max |logit err|", "greedy = fp32", "weights", "peak activations"):
        t.add_column(col, justify="left" if col == "variant" else "right", no_wrap=col == "variant")
    for r in report.results:
        o = r.overall
        nf = f"[red]{o.nonfinite_logits}[/]" if o.nonfinite_logits else "0"
        greedy = f"{o.greedy_matched}/{o.greedy_total}" if o.greedy_total else "-"
        t.add_row(r.name, "yes" if r.variant.custom_runtime else "no", nf, _opt(o.kl_mean, ".3e"), _opt(o.top1, ".2%"),
                  _opt(o.perplexity, ".4g"), _opt(o.max_abs_logit_error, ".3g"), greedy, _bytes(r.parameter_bytes),
                  _bytes(r.peak_activation_bytes))
    console.print(t)
    if len(report.texts) > 1:
        for i, text in enumerate(report.texts):
            per = Table(title=_plain(text["name"]), title_justify="left")
            for col in ("variant", "non-finite logits", "KL / token", "top-1", "perplexity", "greedy = fp32"):
                per.add_column(col, justify="left" if col == "variant" else "right")
            for r in report.results:
                m = r.per_text[i]
                per.add_row(r.name, str(m.nonfinite_logits), _opt(m.kl_mean, ".3e"), _opt(m.top1, ".2%"), _opt(m.perplexity, ".4g"),
                            f"{m.greedy_matched}/{m.greedy_total}" if m.greedy_total else "-")
            console.print(per)
    collapse = [r for r in report.results if r.overall.uniform_positions is not None]
    if collapse:
        c = Table(title="Finite but broken? (entropy of each position's distribution; a row is near-uniform above 90% of "
                        "log(vocab))", title_justify="left")
        for col in ("variant", "non-finite positions", "mean entropy (nats)", "became near-uniform", "most frequent top-1",
                    "collapsed"):
            c.add_column(col, justify="left" if col == "variant" else "right", no_wrap=col == "variant")
        for r in collapse:
            o = r.overall
            c.add_row(r.name, f"{o.nonfinite_positions}/{o.positions}", _opt(o.entropy_mean, ".3g"),
                      f"{o.uniform_positions}/{o.positions}", _opt(o.mode_fraction, ".1%"),
                      "[red]yes[/]" if o.collapsed else "no")
        console.print(c)
    for name, why in report.skipped.items():
        console.print(f"[yellow]skipped {name}:[/] {why}")
    ref = next((r for r in report.results if r.name == "fp32"), None)
    if ref is not None:
        console.print(f"KL and top-1 compare each variant's logits with fp32's at every position; greedy: of {report.greedy_tokens} "
                      f"tokens generated from the first {report.prompt_tokens} of each text, those equal to fp32's before the first "
                      "difference. Peak activations: one forward pass, beyond the weights.")
