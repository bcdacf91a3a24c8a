"""The one way to list and run the benchmarks (each a script of this folder whose name does not start with "_"):

  python benchmarks/run.py --list              # every benchmark and what it measures
  python benchmarks/run.py NAME [ARGS...]      # run one: NAME is its file name without bench_ and .py
  python benchmarks/run.py NAME --help         # its options

A benchmark runs as its script would (``python benchmarks/<file>.py ARGS``) with the repository and this folder on
the import path, so no PYTHONPATH is needed. Each prints its figures side by side with the machine and its load;
docs/benchmarks.md gives the current figures, the command and the machine that produced them.
"""

from __future__ import annotations

import ast
import runpy
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def benchmarks() -> dict[str, Path]:
    """Every benchmark script by its short name (``bench_moe.py``: ``moe``; ``startup_memory.py``: itself)."""
    scripts = sorted(path for path in HERE.glob("*.py") if not path.name.startswith("_") and path != Path(__file__))
    return {path.stem.removeprefix("bench_"): path for path in scripts}


def summary(path: Path) -> str:
    """The first sentence of a script's docstring (read without importing it)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    first = " ".join(docstring.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".")


def main(argv: list[str]) -> int:
    scripts = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--list":
        width = max(map(len, scripts)) + 2
        for name, path in scripts.items():
            print(textwrap.fill(summary(path), 116, initial_indent=f"{name:<{width}}", subsequent_indent=" " * width))
        return 0
    name, args = argv[0], argv[1:]
    if name not in scripts:
        print(f"benchmarks/run.py: no benchmark {name!r}; `python benchmarks/run.py --list` lists them "
              f"({', '.join(scripts)})", file=sys.stderr)
        return 2
    sys.path[:0] = [str(HERE), str(REPO)]
    sys.argv = [str(scripts[name]), *args]
    runpy.run_path(str(scripts[name]), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
