"""How ``resilient-ckpt`` prints: human tables on stdout, JSON with ``--json``, progress on stderr.

Presentation only; every number comes from the library (``resilient.storage.*``).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """``512MiB``, ``2G``, ``5GB``, ``1048576`` -> bytes (K/M/G/T alone are binary, as in ``ls -h``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 5GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def progress_bar(enabled: bool, desc: str):
    """A factory ``total_bytes -> bar`` (a tqdm bar with ``update(n)``), or None when quiet."""
    if not enabled:
        return None

    def make(total: int):
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )

    return make


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) if shape else "()"


def render_ls(listing: dict) -> None:
    print(f"{listing['root']}  (latest: {listing['latest']})")
    print(f"{'step':>10}  {'status':<11} {'size':>10}  {'tensors':>7}  {'created':<20}  attempt")
    for s in listing["steps"]:
        status = ("DAMAGED" if s["problem"] else "committed") if s["committed"] else "UNCOMMITTED"
        created = s["created_at"] or "-"
        print(
            f"{s['step']:>10}  {status:<11} {human(s['bytes']):>10}  {s['tensors']:>7}  {created:<20}  "
            f"{s['attempt'] or '-'}"
        )
        if s["problem"]:
            print(f"{'':>12}! {s['problem']}")
        for orphan in s["orphan_attempts"]:
            print(f"{'':>12}orphan attempt {orphan} (resilient-ckpt prune removes it)")
    for note in listing["notes"]:
        print(f"note: {note}")


def render_inspect(summary: dict) -> None:
    for damaged in summary.get("damaged", []):
        print(f"! step {damaged['step']} skipped, damaged: {damaged['message']}")
    print(f"{summary['url']}")
    print(
        f"  step {summary['step']}  format v{summary['format_version']}  {summary['attempt']}  "
        f"created {summary['created_at']}  saved by {summary['world_size']} rank(s)"
    )
    shown = f"{len(summary['tensors'])} of " if len(summary["tensors"]) != summary["tensor_count"] else ""
    print(
        f"  {shown}{summary['tensor_count']} tensors, {human(summary['total_bytes'])}; versions "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    )
    if summary.get("save_mesh"):
        print(f"  save-time mesh {_mesh(summary['save_mesh'])}")
    for mesh in summary["meshes"]:
        label = "tensor mesh" if summary.get("save_mesh") else "mesh"
        print(f"  {label} {dict(zip(mesh['dim_names'], mesh['shape'], strict=False)) or mesh['shape']}")
    print(f"\n  {'tensor':<48} {'shape':<16} {'dtype':<9} {'size':>10}  {'shard':<14} {'inner':<14} placements")
    for t in summary["tensors"]:
        print(
            f"  {t['fqn']:<48} {_shape(t['shape']):<16} {t['dtype']:<9} {human(t['bytes']):>10}  "
            f"{_shape(t['shard_shape']):<14} {_shape(t['inner_shape']):<14} {','.join(t['placements']) or '-'}"
        )
    if summary["values"]:
        print("\n  values:")
        for fqn, v in summary["values"].items():
            text = json.dumps(v.get("value", v))
            print(f"    {fqn} = {text if len(text) <= 100 else text[:97] + '...'}")
    if summary["metadata"]:
        print(f"\n  metadata: {json.dumps(summary['metadata'])[:300]}")


def render_verify(reports: list[dict]) -> None:
    for r in reports:
        # One block per step, damaged or not, and a last line that counts them.
        head = "OK" if r["ok"] else f"DAMAGED, {len(r['problems'])} PROBLEM(S)"
        print(
            f"step {r['step']} {r['url']}: {head} ({r['tensors']} tensors, {human(r['bytes_read'])} read "
            f"in {r['seconds']:.2f} s)"
        )
        for p in r["problems"]:
            where = " ".join(filter(None, (p["fqn"], p["chunk"])))
            print(f"  [{p['kind']}] {where + ': ' if where else ''}{p['message']}")
    if len(reports) > 1:
        damaged = [r["step"] for r in reports if not r["ok"]]
        print(f"{len(reports)} step(s) checked, {len(damaged)} damaged" + (f": {damaged}" if damaged else ""))


def render_diff(result: dict) -> None:
    print(f"a: {result['a']}\nb: {result['b']}")
    for fqn in result["added"]:
        print(f"  + {fqn} (only in b)")
    for fqn in result["removed"]:
        print(f"  - {fqn} (only in a)")
    for c in result["shape_or_dtype_changed"]:
        print(
            f"  ! {c['fqn']}: {_shape(c['a']['shape'])} {c['a']['dtype']} -> {_shape(c['b']['shape'])} "
            f"{c['b']['dtype']}"
        )
    for c in result["changed"]:
        print(f"  ~ {c['fqn']}: {c['changed_elements']}/{c['numel']} elements differ, max |a-b| = {c['max_abs_diff']}")
    for kind, mark in (("values_added", "+"), ("values_removed", "-"), ("values_changed", "~")):
        for fqn in result[kind]:
            print(f"  {mark} value {fqn}")
    verdict = "identical" if result["identical"] else "DIFFERENT"
    print(
        f"{verdict} (atol {result['atol']}; {result['unchanged']} tensor(s) unchanged, "
        f"{len(result['changed'])} changed)"
    )


def render_summary(result: dict) -> None:
    """convert / reshard: one line of what was written."""
    where = result.get("url") or result.get("dst")
    files = f", {len(result['files'])} file(s)" if "files" in result else ""
    print(
        f"wrote {where}: {result['tensors']} tensors, {human(result['bytes'])}{files}"
        + (f" in {result['seconds']:.1f} s" if "seconds" in result else "")
    )


def _mesh(mesh: dict | list | None) -> str:
    if mesh is None:
        return "no device mesh"
    meshes = mesh if isinstance(mesh, list) else [mesh]
    return " + ".join(" x ".join(f"{k}={v}" for k, v in m.items()) for m in meshes)


def render_reshard(result: dict) -> None:
    render_summary(result)
    origin, target = result["resharded_from"], result["resharded_to"]
    to = _mesh(target["mesh"]) if "mesh" in target else "chunks " + ", ".join(target["chunks"])
    print(f"  from step {origin['step']} saved on {_mesh(origin['mesh'])} ({origin['world_size']} rank(s)) to {to}")
    for dim in result.get("splits_no_tensor", []):
        print(f"  note: {dim['dim']}={dim['size']} splits no tensor: {dim['reason']}")
    for group in result["not_applied"]:
        names = group["tensors"]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        print(
            f"  note: {group['dim']}={group['size']} does not apply to {len(names)} tensor(s), "
            f"{group['reason']}: {shown}"
        )


def render_prune(result: dict) -> None:
    verb = "would delete" if result["dry_run"] else "deleted"
    for key in result["planned"]:
        print(f"{verb} {result['root']}/{key}")
    for key in result["spared"]:
        print(f"kept {result['root']}/{key} (latest is {result['latest']}: nothing at or after it is pruned)")
    for step in result.get("damaged", []):
        print(f"damaged step {step}: its manifest is unreadable, left as it is (run resilient-ckpt verify)")
    print(f"{len(result['planned'])} {verb}; committed steps kept: {result['kept_committed']}")
