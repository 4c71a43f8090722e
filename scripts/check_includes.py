#!/usr/bin/env python3
"""Fails when a file under src/ includes a header from a higher layer (DESIGN §8:
dependencies point down). Layers, lowest first; a folder may include its own
layer and any lower one. Run by scripts/test.sh."""
import re
import sys
from pathlib import Path

LAYERS = ["core", "kernels", "backend", "kv", "model", "engine", "eval", "serve", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')

root = Path(__file__).resolve().parent.parent / "src"
bad = []
for f in sorted(root.rglob("*")):
    if f.suffix not in {".h", ".cpp", ".cu", ".cuh"}:
        continue
    layer = f.relative_to(root).parts[0]
    if layer not in RANK:
        bad.append(f"{f.relative_to(root)}: folder '{layer}' has no layer in scripts/check_includes.py")
        continue
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        m = INCLUDE.match(line)
        if m and m.group(1) in RANK and RANK[m.group(1)] > RANK[layer]:
            bad.append(f"src/{f.relative_to(root)}:{n}: {layer}/ includes {m.group(1)}/ (a higher layer)")
for b in bad:
    print(b)
print(f"check_includes: {len(bad)} upward include(s)" if bad else "check_includes: all includes point down")
sys.exit(1 if bad else 0)
