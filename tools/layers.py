#!/usr/bin/env python3
"""layers.py — the include and call graph of fp8c's sources, by layer, and its one rule.

fp8c is built in layers that import one way:

    ir -> passes -> codegen -> runtime -> cuda -> compiler

(the CPU backend's executor lives in runtime/, its renderer in codegen/). A file may include
the headers of its own layer and of the layers before it, and call functions defined there;
an arrow the other way, from a lower layer to a higher one, is what turns two layers into one
knot (passes/fuse.c and codegen/lower_kernels.c once called each other). The binaries' main.c
files (compiler/main.c, runtime/main.c) sit above everything and may use any layer.

This script reads the C sources (not tests/ or tools/), assigns each file to its layer by its
directory, and finds two kinds of arrows:
  include  a file's #include "x.h" of a header of another layer;
  call     a file's use (a call, or a function pointer taken) of a function that is defined,
           not static, in a file of another layer.
It prints the layer graph (arrows between layers, with how many include and call edges make
each), writes it as Graphviz with --dot FILE (`dot -Tsvg FILE` draws it), and exits 1 when an
arrow goes from a lower layer to a higher one, naming every edge that does, or when the layer
graph has a circle. CTest runs it (test_layers), so the rule stays true.

    tools/layers.py [--root DIR] [--dot FILE] [--files]

--files also lists every cross-layer edge, file to file. Parsing is lexical (comments and
strings removed, then identifiers), which is enough for this tree's style: functions are
defined at the start of a line, and a name is unique among non-static functions.
"""
import argparse
import os
import re
import sys
from collections import defaultdict

LAYERS = ["ir", "passes", "codegen", "runtime", "cuda", "compiler"]
EXEMPT = {"compiler/main.c", "runtime/main.c"}   # the binaries: above every layer

KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "else", "do", "case",
            "_Static_assert", "static_assert", "__attribute__", "typeof", "_Alignof", "alignof"}


def strip_c(text):
    """Comments and string/char literals blanked, newlines kept (line numbers stay right)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * max(0, j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def layer_of(rel):
    top = rel.split("/", 1)[0]
    return top if top in LAYERS else None


def sources(root):
    for layer in LAYERS:
        d = os.path.join(root, layer)
        for dirpath, _, names in os.walk(d):
            for name in sorted(names):
                if name.endswith((".c", ".h")):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, root).replace(os.sep, "/")


# a function definition: at the start of a line, a return type, a name, '(' ... ')' then '{'
DEF_RE = re.compile(r"^(?!static\b)(?!typedef\b)(?!extern\b)[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*\([^;{]*?\)\s*\{",
                    re.M | re.S)
ANY_DEF_RE = re.compile(r"^[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*\([^;{]*?\)\s*\{", re.M | re.S)
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
IDENT_RE = re.compile(r"\b([A-Za-z_]\w*)\b")


def analyse(root):
    files = list(sources(root))
    code = {}
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            raw = f.read()
        code[rel] = (raw, strip_c(raw))
    by_name = defaultdict(list)            # header basename -> paths
    for rel in files:
        if rel.endswith(".h"):
            by_name[os.path.basename(rel)].append(rel)
    defined = defaultdict(set)             # function -> files defining it (not static)
    for rel, (_, c) in code.items():
        if not rel.endswith(".c"):
            continue
        for m in DEF_RE.finditer(c):
            name = m.group(1)
            if name not in KEYWORDS:
                defined[name].add(rel)
    edges = []                             # (kind, from file, to file, what)
    for rel, (raw, c) in code.items():
        here = os.path.dirname(rel)
        for m in INCLUDE_RE.finditer(raw):
            inc = m.group(1)
            target = os.path.normpath(os.path.join(here, inc)).replace(os.sep, "/")
            if target not in code:
                cands = by_name.get(os.path.basename(inc), [])
                target = cands[0] if len(cands) == 1 else None
            if target:
                edges.append(("include", rel, target, inc))
        if not rel.endswith(".c"):
            continue
        own = {m.group(1) for m in ANY_DEF_RE.finditer(c)}   # its statics shadow others' names
        seen = set()
        for m in IDENT_RE.finditer(c):
            name = m.group(1)
            if name in seen or name in own or name not in defined:
                continue
            before = c[:m.start()].rstrip()[-2:]
            if before.endswith(".") or before == "->":   # a struct member of the same name
                continue
            seen.add(name)
            for target in sorted(defined[name]):
                edges.append(("call", rel, target, name))
    return files, edges


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--dot", help="write the layer graph as Graphviz to this file")
    ap.add_argument("--files", action="store_true", help="list every cross-layer edge")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    files, edges = analyse(root)
    if not files:
        print(f"layers: no sources under {root}", file=sys.stderr)
        return 2
    rank = {l: i for i, l in enumerate(LAYERS)}
    arrows = defaultdict(lambda: {"include": 0, "call": 0})
    wrong = []
    cross = []
    for kind, a, b, what in edges:
        la, lb = layer_of(a), layer_of(b)
        if la == lb:
            continue
        cross.append((kind, a, b, what))
        if a in EXEMPT:
            continue
        arrows[(la, lb)][kind] += 1
        if rank[la] < rank[lb]:
            wrong.append((kind, a, b, what))

    counts = defaultdict(int)
    for f in files:
        counts[layer_of(f)] += 1
    print("layers (each may use those above it in this list):")
    for l in LAYERS:
        outs = [(lb, arrows[(la, lb)]) for (la, lb) in sorted(arrows, key=lambda k: rank[k[1]]) if la == l]
        uses = ", ".join(f"{lb} ({n['include']} includes, {n['call']} calls)" for lb, n in outs)
        print(f"  {l:9s} {counts[l]:3d} files  uses: {uses or 'nothing'}")
    print(f"  (exempt, above all: {', '.join(sorted(EXEMPT))})")

    # a circle in the layer graph: some layer reaches itself
    graph = defaultdict(set)
    for (la, lb) in arrows:
        graph[la].add(lb)
    circles = []
    for start in LAYERS:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(path + [start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))

    if args.files:
        print("cross-layer edges:")
        for kind, a, b, what in sorted(cross):
            print(f"  {a} -> {b}  ({kind} {what})")
    if args.dot:
        with open(args.dot, "w") as f:
            f.write("digraph fp8c_layers {\n  rankdir=LR;\n  node [shape=box];\n")
            for l in LAYERS:
                f.write(f'  "{l}" [label="{l}\\n{counts[l]} files"];\n')
            for (la, lb), n in sorted(arrows.items()):
                bad = rank[la] < rank[lb]
                f.write(f'  "{la}" -> "{lb}" [label="{n["include"]}i {n["call"]}c"'
                        f'{", color=red" if bad else ""}];\n')
            f.write('  "main.c" [shape=ellipse];\n')
            f.write('  "main.c" -> "compiler" [style=dashed];\n}\n')
        print(f"wrote {args.dot}")

    if wrong:
        print(f"layers: {len(wrong)} arrow(s) from a lower layer to a higher one:", file=sys.stderr)
        for kind, a, b, what in sorted(wrong):
            print(f"  {a} ({layer_of(a)}) -> {b} ({layer_of(b)}): {kind} {what}", file=sys.stderr)
    for c in circles:
        print("layers: a circle: " + " -> ".join(c), file=sys.stderr)
    if wrong or circles:
        return 1
    print("layers: one way, no circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
