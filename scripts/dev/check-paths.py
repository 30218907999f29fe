#!/usr/bin/env python3
"""Finds repository paths named in the tracked .rs, .md and .toml files that
do not exist, so that docs and comments never point at a moved or deleted
file. Python 3 standard library only; a second or two.

    scripts/dev/check-paths.py            # prints FILE:LINE: PATH, exits 1 if any
    scripts/dev/check-paths.py --verbose  # also says how many paths it checked

What counts as a path:
  * a word starting with a top-level folder of the repository
    (`src/daemon/device.rs`, `docs/x.md`, `scripts/dev/fuzz.sh`, `tests/`,
    `kernels/...`), resolved from the repository root;
  * a top-level file named as such (`Cargo.toml`, `SECURITY.md`,
    `DESIGN.md`): found beside the naming file or at the root;
  * a relative Markdown link target (`[x](../kernels/NOTES.md#anchor)`),
    resolved from the naming file's folder; its `#anchor`, when the target
    is a Markdown file, must be a heading (GitHub's slug) or an `<a id>`.
Left alone: URLs, absolute paths (`/etc/replayd`, `/tmp`), module-relative
names (`plan.rs`), globs and placeholders (`*`, `{a,b}`, `<name>`, `$OUT`,
`...`, an all-capitals component such as `TARGET`), and anything git
ignores (`target/`, `models/`, `.carry/`, fuzz artifacts).
"""
import os
import re
import subprocess
import sys
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Vendored sources name paths of their own upstream trees; generated test
# data is not prose.
SKIP_FILES = ("third_party/", "tests/data/models/")


def git(*args, stdin=None):
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, check=False).stdout


def tracked():
    return [f for f in git("ls-files", "-z").split("\0")
            if f.endswith((".rs", ".md", ".toml")) and not f.startswith(SKIP_FILES)]


TOP_DIRS = sorted({f.split("/", 1)[0] for f in git("ls-files").splitlines() if "/" in f}
                  - {"third_party"}) + ["third_party"]
TOP_FILES = ("README.md", "SECURITY.md", "DESIGN.md", "CHANGELOG.md", "CONTRIBUTING.md",
             "Cargo.toml", "Cargo.lock", "Makefile")

PREFIXED = re.compile(r"(?<![\w./$~@:-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS)
                      + r")/[\w./*{}<>$…-]*)")
BARE_TOP = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w-])")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[*?{}<>$…]|\.\.\.|(^|/)[A-Z][A-Z0-9_]{2,}(/|$|\.)")


def clean(path):
    return path.rstrip(".,;:`'\"")


@lru_cache(maxsize=None)
def ignored(path):
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                          capture_output=True).returncode == 0


def slug(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)   # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(md_path):
    found, seen, fence = set(), {}, False
    with open(md_path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fence = not fence
            if fence:
                continue
            m = re.match(r"#{1,6} (.*)", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else f"{s}-{n}")
            found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))
    return found


def problems(name, text):
    here = os.path.dirname(name)
    for lineno, line in enumerate(text.split("\n"), 1):
        for m in PREFIXED.finditer(line):
            path = clean(m.group(1))
            if PLACEHOLDER.search(path):
                continue
            if not os.path.exists(os.path.join(ROOT, path)) and not ignored(path):
                yield lineno, path
        for m in BARE_TOP.finditer(line):
            path = m.group(1)
            if not (os.path.exists(os.path.join(ROOT, here, path))
                    or os.path.exists(os.path.join(ROOT, path))):
                yield lineno, path
        if not name.endswith(".md"):
            continue
        for m in MD_LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or PLACEHOLDER.search(target.split("#")[0]):
                continue
            path, _, frag = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, here, path)) if path else os.path.join(ROOT, name)
            if path and not os.path.exists(full):
                rel = os.path.relpath(full, ROOT)
                if not ignored(rel):
                    yield lineno, target
                continue
            if frag and full.endswith(".md") and os.path.isfile(full) and frag not in anchors(full):
                yield lineno, target


def main():
    verbose = "--verbose" in sys.argv[1:]
    bad, files = 0, tracked()
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for lineno, path in problems(name, text):
            print(f"{name}:{lineno}: {path}")
            bad += 1
    if verbose:
        print(f"check-paths: {len(files)} files, {bad} missing", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
