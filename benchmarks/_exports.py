"""The benchmark's MoE blocks: their shapes, where their exports are and how to make the missing ones
(their optimized forms: ``_models.load_models``).

The large blocks are exported by models/export_moe_blocks.py, which needs torch and transformers: a
Python of one of the export environments of models/README.md, given by option or environment
variable (`ENVIRONMENTS`). `--fixtures` benchmarks the small committed fixtures of the same styles
instead, which need neither.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPORT_SCRIPT = REPO / "models" / "export_moe_blocks.py"
FIXTURES = REPO / "models" / "fixtures"


@dataclass(frozen=True)
class ExportEnvironment:
    """A Python with torch and one transformers version, as models/README.md makes it."""

    transformers: str
    requirements: str  # in models/
    option: str  # the command-line option naming its python
    variable: str  # the environment variable read when the option is not given

    def setup_commands(self, venv: str) -> list[str]:
        """models/README.md's commands making this environment in the directory `venv`."""
        return [f"python3 -m venv {venv}", f"{venv}/bin/pip install torch==2.13.0",
                f"{venv}/bin/pip install -r {REPO / 'models' / self.requirements}"]


ENVIRONMENTS = {
    "457": ExportEnvironment("4.57", "requirements-export-457.txt", "--export-python-457",
                             "MOE_ONNX_EXPORT_PYTHON_457"),
    "5": ExportEnvironment("5", "requirements-export-5.txt", "--export-python-5",
                           "MOE_ONNX_EXPORT_PYTHON_5"),
}


def add_export_options(parser: argparse.ArgumentParser, keys: Iterable[str] = tuple(ENVIRONMENTS)) -> None:
    """The options naming the python of the environments `keys` (--export-python-457, --export-python-5),
    defaulting to their environment variables."""
    for key in keys:
        env = ENVIRONMENTS[key]
        parser.add_argument(env.option, metavar="PY", dest=f"export_python_{key}",
                            default=os.environ.get(env.variable),
                            help=f"python with torch + transformers {env.transformers}, to export missing blocks "
                                 f"(default: ${env.variable})")


def export_pythons(args: argparse.Namespace) -> dict[str, str | None]:
    """The python of each export environment from `add_export_options`' options (key -> path or None)."""
    return {key: getattr(args, f"export_python_{key}", None) for key in ENVIRONMENTS}


@dataclass(frozen=True)
class Shape:
    """One benchmarked block: its export (family, style, the environment that exports it) and sizes."""

    name: str
    family: str
    style: str
    environment: str  # a key of ENVIRONMENTS
    E: int
    k: int
    H: int
    I: int
    gemm2: bool  # GEMM2 + biases (GPT-OSS) rather than GEMM3
    fixture: str | None = None  # the committed fixture benchmarked instead of an export

    @property
    def stem(self) -> str:
        """The file name (without .onnx) of the export and of its cached forms."""
        return self.fixture or f"{self.family}_{self.style}_E{self.E}_k{self.k}_H{self.H}_I{self.I}"

    def source(self, models_dir: Path) -> Path:
        """The export (or committed fixture) the benchmark starts from."""
        return FIXTURES / f"{self.fixture}.onnx" if self.fixture else models_dir / f"{self.stem}.onnx"

    def export_command(self, python: str, models_dir: Path) -> list[str]:
        return [python, str(EXPORT_SCRIPT), "--family", self.family, "--style", self.style,
                "--hidden", str(self.H), "--intermediate", str(self.I), "--experts", str(self.E),
                "--topk", str(self.k), "-o", str(self.source(models_dir))]

    def expert_bytes(self, itemsize: int = 4) -> int:
        """Bytes of one expert's weights (and biases)."""
        n = 3 * self.H * self.I + (2 * self.I + self.H if self.gemm2 else 0)
        return n * itemsize


SHAPES = {
    "gpt_oss": Shape("gpt_oss", "gpt_oss", "tiled", "457", 32, 4, 1024, 1024, True),
    "qwen3": Shape("qwen3", "qwen3_moe", "tiled3", "5", 64, 8, 1024, 384, False),
}


def fixture_shape(shape: Shape) -> Shape:
    """`shape`'s family and style at the size of its committed `small` fixture."""
    name = f"{shape.family}_{shape.style}_small"
    entry = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"][name]
    return replace(shape, E=entry["num_experts"], k=entry["top_k"], H=entry["hidden_size"],
                   I=entry["intermediate_size"], fixture=name)


def ensure_export(shape: Shape, models_dir: Path, pythons: dict[str, str | None]) -> Path | None:
    """The block's export, made first when it is missing and its environment's python is known
    (`pythons`: environment key -> python or None); None when it cannot be made (see `how_to_export`)."""
    source = shape.source(models_dir)
    if source.exists():
        return source
    python = pythons.get(shape.environment)
    if not python:
        env = ENVIRONMENTS[shape.environment]
        print(f"[{shape.name}] missing {source}; no python with transformers {env.transformers} given "
              f"({env.option} or {env.variable})", flush=True)
        return None
    command = shape.export_command(python, models_dir)
    print(f"[{shape.name}] exporting: {shlex.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0:
        print(f"[{shape.name}] the export failed", flush=True)
        return None
    return source


def how_to_export(shapes: list[Shape], models_dir: Path) -> str:
    """What to run to make the exports of `shapes`: models/README.md's commands making each export
    environment, then the exports; and the options that name existing environments."""
    lines = []
    for key, env in ENVIRONMENTS.items():
        exports = [s for s in shapes if s.environment == key]
        if not exports:
            continue
        venv = f"export-venv-{key}"
        lines.append(f"torch + transformers {env.transformers}: make the environment and export (or give the python "
                     f"of an existing one with {env.option} PY or {env.variable}=PY, and the benchmark exports):")
        lines += [f"  {c}" for c in env.setup_commands(venv)]
        lines += [f"  {shlex.join(s.export_command(f'{venv}/bin/python', models_dir))}" for s in exports]
    return "\n".join(lines)
