"""Copy-paste check over the project's Jac and Python sources: repeated runs of lines, found as
normalised line windows (whitespace, comments, blank lines and lines of only brackets dropped).

    python scripts/jac_duplicates.py                 # print every repeated run of >= 6 lines
    python scripts/jac_duplicates.py --check         # the same, and exit 1 when there is one
    python scripts/jac_duplicates.py --min-lines 4 engine walkers
    python scripts/jac_duplicates.py --min-lines 1 --min-chars 60 engine   # repeated long lines

Each pair is printed with both places (file:first-last line) and the run's length in normalised
lines. The files are those git tracks (or, outside a checkout, every .jac and .py file) under the
given paths, tests included, `.venv` and generated folders aside.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".jac", ".py")
SKIPPED = {".venv", ".jac", "__pycache__", "node_modules", "build", "dist"}
COMMENT = re.compile(r"^\s*#")


def source_files(paths: list[str]) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
        files = [ROOT / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        files = [f for p in paths for f in (ROOT / p).rglob("*")]
    return sorted(f for f in files if f.suffix in SUFFIXES and f.is_file()
                  and not SKIPPED & set(f.relative_to(ROOT).parts))


def normalised(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines that count: stripped, inner whitespace collapsed; blank
    lines, comment lines and lines without a letter or digit left out."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if COMMENT.match(line):
            continue
        text = " ".join(line.split())
        if any(c.isalnum() for c in text):
            out.append((number, text))
    return out


def find_pairs(files: list[Path], size: int, min_chars: int = 0) -> list[tuple[int, tuple[Path, int, int], tuple[Path, int, int]]]:
    """Maximal repeated runs of at least `size` normalised lines (and `min_chars` characters, not
    counting import lines), each as (length, first place, second place); a place is (file, first
    line, last line)."""
    lines = {f: normalised(f) for f in files}
    windows: dict[tuple[str, ...], list[tuple[Path, int]]] = defaultdict(list)
    for f, rows in lines.items():
        for i in range(len(rows) - size + 1):
            window = tuple(text for _, text in rows[i:i + size])
            if sum(len(t) for t in window if not t.startswith(("import ", "from "))) >= min_chars:
                windows[window].append((f, i))
    # Window starts that repeat, paired; then each pair grown forward as far as the lines agree.
    starts: set[tuple[Path, int, Path, int]] = set()
    for places in windows.values():
        for a in range(len(places)):
            for b in range(a + 1, len(places)):
                (fa, ia), (fb, ib) = places[a], places[b]
                if fa != fb or abs(ia - ib) >= size:
                    starts.add((fa, ia, fb, ib))
    pairs = []
    for fa, ia, fb, ib in sorted(starts, key=lambda s: (str(s[0]), s[1], str(s[2]), s[3])):
        if (fa, ia - 1, fb, ib - 1) in starts:
            continue  # inside a run that started earlier
        length = size
        ra, rb = lines[fa], lines[fb]
        while (ia + length < len(ra) and ib + length < len(rb) and ra[ia + length][1] == rb[ib + length][1]
               and (fa != fb or ia + length < ib)):
            length += 1
        pairs.append((length, (fa, ra[ia][0], ra[ia + length - 1][0]), (fb, rb[ib][0], rb[ib + length - 1][0])))
    return sorted(pairs, key=lambda p: (-p[0], str(p[1][0]), p[1][1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["."], help="folders or files to read (default: the repository)")
    parser.add_argument("--min-lines", type=int, default=6, help="shortest run reported (default 6)")
    parser.add_argument("--min-chars", type=int, default=0, help="shortest run reported, in characters (default 0)")
    parser.add_argument("--check", action="store_true", help="exit 1 when any pair is found")
    args = parser.parse_args()
    files = source_files(args.paths)
    pairs = find_pairs(files, args.min_lines, args.min_chars)
    for length, (fa, a0, a1), (fb, b0, b1) in pairs:
        print(f"{length} lines: {fa.relative_to(ROOT)}:{a0}-{a1} and {fb.relative_to(ROOT)}:{b0}-{b1}")
    print(f"{len(files)} files ({sum(f.suffix == '.jac' for f in files)} .jac), {len(pairs)} repeated runs of >= {args.min_lines} lines")
    return 1 if args.check and pairs else 0


if __name__ == "__main__":
    sys.exit(main())
