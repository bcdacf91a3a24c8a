"""What the benchmark prints: a line per token count while it runs, then Markdown tables and each
performance target against this run's figures.

A shape's results (made by _measure.py) are a dict: `results` {tokens: {med, ratios, errors, touched,
bandwidth}}, `int8` {tokens: {rows, fp32, int8, speedup, gops}}, `grouped_note`, `creation`
(fused session creation, the export's alone, in s), `runs` (when merged from several) and `rss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _exports import Shape

LOW_PRECISION_KEYS = ("fp16", "bf16")


def fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if v < 100 else f"{v:.0f}"


def ratio(r: dict, a: str, b: str) -> str:
    """The side-by-side ratio a / b of one token count's results ("-" when a variant did not run)."""
    v = r["ratios"].get(f"{a}/{b}")
    return "-" if v is None else f"{v:.2f}x"


def print_row(tokens: int, r: dict) -> None:
    """One token count's medians, as soon as they are measured."""
    m = r["med"]
    parts = [f"T={tokens:<4}", f"fused {fmt(m['fused'])} (MOE node alone {fmt(m['node'])})",
             f"bound {fmt(m['bound'])} (flops {fmt(m['flops'])}, "
             f"bytes {fmt(m['bytes'])} for {r['touched']} experts at {r['bandwidth']:.1f} GB/s)"]
    for name in ("unfused", "ort_moe", "grouped", "python", *LOW_PRECISION_KEYS):
        if name in m:
            err = f", err {r['errors'][name]:.1e}" if name in LOW_PRECISION_KEYS else ""
            parts.append(f"{name} {fmt(m[name])}{err}")
    print("  ".join(parts) + "  [ms]", flush=True)


def print_int8_row(tokens: int, r: dict, N: int, K: int) -> None:
    print(f"T={tokens:<4} int8 MoeRowParallelLinear [{r['rows']} rows, N={N}, K={K}]: fp32 {fmt(r['fp32'])} ms "
          f"({r['gops']['fp32']:.0f} GFLOP/s), int8 {fmt(r['int8'])} ms ({r['gops']['int8']:.0f} GOP/s), "
          f"int8 throughput {r['speedup']:.2f}x fp32", flush=True)


# ----------------------------------------------------------------------------- Markdown

def markdown(shapes: list[tuple[Shape, dict]], threads: int, rss_tokens: int) -> str:
    """The tables of every measured shape."""
    out = []
    for shape, data in shapes:
        out += _time_table(shape, data, threads)
        out += _precision_table(data)
        out += _int8_table(shape, data)
        if data.get("grouped_note"):
            out.append(f"\ngrouped (cpp) skipped: {data['grouped_note']}")
        out += _rss_table(data, rss_tokens)
    return "\n".join(out)


def _time_table(shape: Shape, data: dict, threads: int) -> list[str]:
    created = data.get("creation")
    creation = f"; session creation {created[0]:.2f} s, the export alone {created[1]:.2f} s" if created else ""
    runs_note = f" and ratios: medians of {data['runs']} runs" if data.get("runs") else ""
    out = [f"\n**{shape.name}** (E={shape.E}, k={shape.k}, H={shape.H}, I={shape.I}, "
           f"{'GEMM2 + biases' if shape.gemm2 else 'GEMM3'}, fp32, {threads} threads; median ms"
           f"{runs_note}{creation})\n",
           "| tokens | fused MOE (cpp) | MOE node alone | bound (flops / bytes) | fused / bound | node / bound "
           "| unfused | unfused / fused | `com.microsoft::MoE` | MoE / fused | grouped (cpp) | grouped / fused |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for tokens, r in data["results"].items():
        m = r["med"]
        out.append(
            f"| {tokens} | {fmt(m['fused'])} | {fmt(m['node'])} | {fmt(m['bound'])} ({fmt(m['flops'])} / "
            f"{fmt(m['bytes'])}) | {ratio(r, 'fused', 'bound')} | {ratio(r, 'node', 'bound')} | "
            f"{fmt(m.get('unfused'))} | {ratio(r, 'unfused', 'fused')} | "
            f"{fmt(m.get('ort_moe'))} | {ratio(r, 'ort_moe', 'fused')} | {fmt(m.get('grouped'))} | "
            f"{ratio(r, 'grouped', 'fused')} |")
    return out


def _precision_table(data: dict) -> list[str]:
    """fp16/bf16 and the Python backend against the fp32 fused model."""
    rows = []
    for tokens, r in data["results"].items():
        m, e = r["med"], r["errors"]
        for key in LOW_PRECISION_KEYS:
            if key in m:
                rows.append(f"| {tokens} | {key} | {fmt(m[key])} | {ratio(r, key, 'fused')} | "
                            f"{fmt(m.get('node_' + key))} | {ratio(r, 'node_' + key, 'node')} | "
                            f"{e[key]:.1e} | {e[key] / e[key + '_scale']:.1e} | {e[key + '_rounding']:.1e} |")
        if "python" in m:
            rows.append(f"| {tokens} | python backend (fp32) | {fmt(m['python'])} | "
                        f"{ratio(r, 'python', 'fused')} | | | {e['python']:.1e} | | |")
    if not rows:
        return []
    return ["\n| tokens | variant | model ms | / fp32 model | MOE node alone ms | / fp32 node "
            "| max abs err vs fp32 | relative to max abs output | rounding the fp32 output alone |",
            "|---|---|---|---|---|---|---|---|---|"] + rows


def _int8_table(shape: Shape, data: dict) -> list[str]:
    if not data.get("int8"):
        return []
    out = [f"\nint8 `MoeRowParallelLinear` (gate/up shape: E={shape.E}, N={2 * shape.I}, K={shape.H}) on "
           "the rows the router makes of T tokens, against fp32 with the same integer values\n",
           "| tokens | rows | fp32 ms | int8 ms | fp32 GFLOP/s | int8 GOP/s | int8 throughput / fp32 |",
           "|---|---|---|---|---|---|---|"]
    for tokens, r in data["int8"].items():
        out.append(f"| {tokens} | {r['rows']} | {fmt(r['fp32'])} | {fmt(r['int8'])} | {r['gops']['fp32']:.0f} | "
                   f"{r['gops']['int8']:.0f} | {r['speedup']:.2f}x |")
    return out


def _rss_table(data: dict, tokens: int) -> list[str]:
    if not data.get("rss"):
        return []
    out = [f"\nRSS at T={tokens} (MB; each variant in its own process): after session "
           "creation, peak during the first run (VmHWM reset after creation), extra = the run's own\n",
           "| variant | created | peak | extra |",
           "|---|---|---|---|"]
    for v, r in data["rss"].items():
        out.append(f"| {v} | {r['created']:.0f} | {r['hwm']:.0f} | {r['hwm'] - r['created']:.0f} |"
                   if "hwm" in r else f"| {v} | - | - | {r.get('error', '')} |")
    return out


# ----------------------------------------------------------------------------- targets

def targets(shapes: list[tuple[Shape, dict]]) -> list[str]:
    """Each performance target against this run's figures: one line per target and shape."""
    out = []
    for shape, data in shapes:
        out += [f"- [{'met' if ok else 'NOT met'}] {shape.name}: {what}: {figures}"
                for what, ok, figures in _shape_targets(shape, data)]
    return out


def _shape_targets(shape: Shape, data: dict) -> list[tuple[str, bool, str]]:
    """(target, met, figures) of one shape."""
    out = []
    res = data["results"]
    rat = {t: r["ratios"] for t, r in res.items()}

    def ratios(key: str, min_tokens: int = 0) -> dict[int, float]:
        return {t: q[key] for t, q in rat.items() if key in q and t >= min_tokens}

    b = ratios("fused/bound")
    out.append(("fused <= 1.25x bound (whole model: router ops + MOE node)", all(v <= 1.25 for v in b.values()),
                ", ".join(f"T={t} {v:.2f}x" for t, v in b.items())))
    nb = ratios("node/bound")
    out.append(("MOE node alone <= 1.25x bound", all(v <= 1.25 for v in nb.values()),
                ", ".join(f"T={t} {v:.2f}x" for t, v in nb.items())))
    o = ratios("ort_moe/fused")
    if o:
        out.append(("fused <= com.microsoft::MoE", all(v >= 1 for v in o.values()),
                    ", ".join(f"T={t} MoE/fused {v:.2f}x" for t, v in o.items())))
    u = ratios("unfused/fused", min_tokens=128)
    need = 0.8 * shape.E / shape.k
    if u:
        out.append((f"unfused/fused >= 0.8 E/k = {need:.1f} at T >= 128", all(v >= need for v in u.values()),
                    ", ".join(f"T={t} {v:.1f}x" for t, v in u.items())))
    for key in LOW_PRECISION_KEYS:
        if 1 in rat and f"{key}/fused" in rat[1]:
            v = rat[1][f"{key}/fused"]
            out.append((f"{key} decode (T=1) <= 0.6x fp32, whole model (router ops and Casts included)",
                        v <= 0.6, f"{v:.2f}x"))
        if 1 in rat and f"node_{key}/node" in rat[1]:
            v = rat[1][f"node_{key}/node"]
            out.append((f"{key} decode (T=1) <= 0.6x fp32, MOE node alone", v <= 0.6, f"{v:.2f}x"))
        errs = {t: r["errors"][key] / r["errors"][key + "_scale"] for t, r in res.items() if key in r["errors"]}
        if errs:
            out.append((f"{key} error within 1e-2 (relative to the largest output)",
                        all(v <= 1e-2 for v in errs.values()), ", ".join(f"T={t} {v:.1e}" for t, v in errs.items())))
    g = ratios("grouped/fused")
    if g:
        out.append(("grouped (cpp) within 1.3x of MOE", all(v <= 1.3 for v in g.values()),
                    ", ".join(f"T={t} {v:.2f}x" for t, v in g.items())))
    if 128 in rat and "python/fused" in rat[128]:
        v = rat[128]["python/fused"]
        out.append(("Python backend within 5x of cpp at T=128", v <= 5, f"{v:.2f}x"))
    if data.get("int8"):
        i8 = {t: r["speedup"] for t, r in data["int8"].items()}
        out.append((f"int8 MoeRowParallelLinear >= 1.5x fp32 throughput at T >= 128 ({shape.k} rows per token)",
                    all(v >= 1.5 for v in i8.values()),
                    ", ".join(f"T={t} ({data['int8'][t]['rows']} rows) {v:.2f}x" for t, v in i8.items())))
    rss = data.get("rss", {}).get("fused (cpp)")
    if rss and "hwm" in rss:
        tokens = max(res)
        unit = tokens * shape.k * max(shape.H, 2 * shape.I) * 4 / 2**20
        extra = rss["hwm"] - rss["created"]
        out.append(("fused extra memory O(T*k*max(H, 2I))", extra <= 4 * unit + 16,
                    f"{extra:.0f} MB at T={tokens} = {extra / unit:.1f} x T*k*max(H, 2I)*4 bytes ({unit:.0f} MB)"))
    return out
