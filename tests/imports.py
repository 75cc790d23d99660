#!/usr/bin/env python3
"""Import cycles among the project's own files: Rust (each crate's files,
by their `crate::` and `super::` paths, comments and test modules left
out, edges into a `mod.rs`/`lib.rs` face ignored unless they name one of
its own files) and the Python SDK (`corral.*` modules, imports made only
for type checking included). Prints each cycle; exits 1 if there is any.

Usage: tests/imports.py [REPO]   (default: this file's repository)
"""

import os
import re
import sys
from collections import defaultdict

RUST_CRATES = ["proto/src", "worker/src", "worker/init/src", "control/harness/src", "control/src"]
FACES = ("mod.rs", "lib.rs", "main.rs")


def rust_edges(root):
    edges = defaultdict(set)
    for src in RUST_CRATES:
        base = os.path.join(root, src)
        files = {}
        for d, _, names in os.walk(base):
            for n in names:
                if n.endswith(".rs"):
                    f = os.path.join(d, n)
                    parts = os.path.relpath(f, base)[:-3].split("/")
                    if parts[-1] in ("mod", "lib", "main"):
                        parts = parts[:-1]
                    files[tuple(parts)] = f

        def resolve(parts):
            for k in range(len(parts), -1, -1):
                if tuple(parts[:k]) in files:
                    return tuple(parts[:k])
            return None

        for here, f in files.items():
            text = open(f, encoding="utf-8").read()
            text = re.split(r"#\[cfg\(test\)\]\s*mod tests\s*\{", text)[0]
            text = "\n".join(l for l in text.split("\n") if not l.strip().startswith("//"))
            for m in re.finditer(
                r"\b(crate|super(?:::super)*)::((?:[a-z_][a-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)", text
            ):
                head, rest = m.group(1), m.group(2).split("::")
                if head == "crate":
                    parts = rest
                else:
                    up = head.count("super")
                    parts = list(here)[: len(here) - up] + rest
                target = resolve(parts)
                if target is None or target == here:
                    continue
                tf = files[target]
                if os.path.basename(tf) in FACES and tuple(parts) != target:
                    continue
                edges[os.path.relpath(f, root)].add(os.path.relpath(tf, root))
    return edges


def python_edges(root):
    base = os.path.join(root, "sdk/python")
    mods = {}
    for d, _, names in os.walk(os.path.join(base, "corral")):
        if "_proto" in d:
            continue
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(d, n)
                m = os.path.relpath(p, base)[:-3].replace("/", ".")
                if m.endswith(".__init__"):
                    m = m[: -len(".__init__")]
                mods[m] = p
    edges = defaultdict(set)
    for m, p in mods.items():
        text = open(p, encoding="utf-8").read()
        found = set()
        for mm in re.finditer(r"^\s*from\s+(corral[\w.]*)\s+import\s+(\([^)]*\)|[^\n]*)", text, re.M):
            t = mm.group(1)
            names = [x.strip().split(" as ")[0] for x in mm.group(2).strip("()").replace("\n", " ").split(",")]
            found.update(t + "." + x for x in names if t + "." + x in mods)
            found.add(t)
        for mm in re.finditer(r"^\s*import\s+(corral[\w.]*)", text, re.M):
            found.add(mm.group(1))
        for t in found:
            if t in mods and t != m and not mods[t].endswith("__init__.py"):
                edges[os.path.relpath(p, root)].add(os.path.relpath(mods[t], root))
    return edges


def cycles(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(100_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rust, python = rust_edges(root), python_edges(root)
    if sum(len(v) for v in rust.values()) < 100 or sum(len(v) for v in python.values()) < 10:
        print("tests/imports.py: found too few imports to judge: is this the repository?", file=sys.stderr)
        return 2
    found = cycles(rust) + cycles(python)
    for c in found:
        print("import cycle: " + " <-> ".join(c))
    print(f"import cycles: {len(found)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
