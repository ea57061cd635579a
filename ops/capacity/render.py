"""A plan as text: the explained table, the JSON object, or the kvops.yaml with its header."""

from __future__ import annotations

from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.core.plan import Plan
from kvops.ops.capacity.outputs import explain


def render(plan: Plan, fmt: str) -> str:
    if fmt == "json":
        return plan.to_json()
    if fmt == "yaml":
        return _yaml(plan)
    rows = explain(plan)
    width = max(len(r[0]) for r in rows)
    lines = [f"{q:<{width}}  {v:>18}  {why}" for q, v, why in rows]
    return "\n".join([*lines, *_trace_lines(plan), *_decision_lines(plan), "", plan.serve])


def _decision_lines(plan: Plan) -> list[str]:
    """Whether offload pays, and what to run when it does (``kvops plan --offload-mode``)."""
    d = plan.offload_decision
    if d is None:
        return []
    c = d.costs
    tiers = (f"L1 {d.l1_gib} GiB" + (f" + disk {d.disk_gib} GiB" if d.disk_gib else "")) if d.l1_gib \
        else "the sized tiers"
    lines = ["", f"offload ({d.transfer_mode}): {d.reason}",
             f"  prompt tokens found: GPU KV alone {d.gpu_hit_ratio:.1%}; with {tiers} {d.hit_ratio:.1%} "
             f"(L1 +{d.l1_hit_ratio:.1%}, disk +{d.disk_hit_ratio:.1%})",
             f"  prefill time: saved {d.prefill_saved_fraction:.1%}, miss overhead {d.miss_overhead_fraction:.1%}, "
             f"net {d.net_saved_fraction:+.1%}",
             f"  costs: L1 hit {c.l1_ttft_ratio:.3g}x, disk hit {c.disk_ttft_ratio:.3g}x of recompute, miss "
             f"+{c.miss_overhead_ratio:.0%}: {c.source}",
             *([f"  hit costs: {c.derivation}"] if c.derivation else []),
             f"  reuse model: {d.reuse_model}"]
    if d.commands:  # the last command is the serve line, printed below
        lines += ["  run, with this plan's kvops.yaml (--out-dir or --yaml), then the serve line below:",
                  *(f"    {c}" for c in d.commands[:-1])]
    return lines


def _trace_lines(plan: Plan) -> list[str]:
    """The trace's LRU curve, in tokens and GiB of this model's KV (``kvops plan --trace``)."""
    trace = plan.trace
    if trace is None:
        return []
    rate = f"{trace.arrival_rate_rps:.2f} req/s" if trace.arrival_rate_rps is not None else "n/a"
    lines = ["", f"trace {trace.source}: {trace.requests} requests over {trace.duration_s:.0f} s ({rate}), "
             f"prefix reuse {trace.prefix_reuse_ratio:.1%} with an unbounded cache",
             "LRU hit ratio by cache size (GPU KV + offload):"]
    for point in trace.curve:
        marks = [m for m, tokens in (("GPU KV", trace.gpu_cache_tokens), ("target", trace.tokens_for_target))
                 if point.cache_tokens == tokens // trace.block_tokens * trace.block_tokens]
        lines.append(f"  {point.cache_tokens:>14,} tokens  {point.cache_gib:>10.1f} GiB  {point.hit_ratio:6.1%}"
                     + (f"  <- {', '.join(marks)}" if marks else ""))
    return lines


def _yaml(plan: Plan) -> str:
    import yaml

    cap = plan.capacity
    header = [f"# kvops.yaml from `kvops plan` — serve with:\n#   {plan.serve}",
              *(f"# {key}: {getattr(plan, key)}" for key in ("gpu_memory_utilization", "max_num_seqs", "max_model_len",
                                                              "max_num_batched_tokens", "kv_cache_dtype")),
              f"# expected: num_blocks {cap.num_blocks}, block_size {cap.block_size}, "
              f"KV cache size {cap.kv_cache_size_tokens} tokens (check with kvops verify)"]
    offload = plan.kvops_yaml.get("offload")
    if offload:
        header.append("# offload: start `kvops offload serve --config kvops.yaml` first"
                      + ("; set disk_path to your disk tier directory" if "disk_path" in offload else ""))
    return "\n".join(header) + "\n" + str(yaml.safe_dump(plan.kvops_yaml, sort_keys=False))


YAML_HINT = ("# the serve line reads kvops.yaml from the directory vllm serve starts in: write it with "
             "`--out-dir DIR` (plan.json, kvops.yaml, serve.sh) or `kvops plan ... --yaml > kvops.yaml`")


def plan_dir_yaml(out_dir: Path) -> Path:
    """Where --out-dir puts kvops.yaml, absolute, so serve.sh works from any directory."""
    return (out_dir / "kvops.yaml").resolve()


def write_plan_dir(plan: Plan, out_dir: Path) -> list[Path]:
    """plan.json, kvops.yaml and an executable serve.sh (the serve line, shlex-quoted)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {"plan.json": plan.to_json() + "\n", "kvops.yaml": _yaml(plan),
                 "serve.sh": f"#!/bin/sh\n# from `kvops plan`: plan.json and kvops.yaml beside this file\n"
                             f"exec {plan.serve} \"$@\"\n"}
        paths = []
        for name, text in files.items():
            path = out_dir / name
            path.write_text(text)
            paths.append(path)
        (out_dir / "serve.sh").chmod(0o755)
    except OSError as exc:
        raise BadInputError(f"--out-dir {out_dir}: {exc.strerror}") from None
    return paths
