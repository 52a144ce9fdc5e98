"""This project as a wheel, for the models the registry logs: built from the source tree the
running code was imported from, once per source hash, cached under $SALA_HOME/wheels.

A logged model names its code by this wheel (registry/models.py), so `pip install -r
requirements.txt` of the model installs exactly that code and its real dependencies, whether or
not a package index holds this project. The version carries the source hash as a local label
(0.1.0+src.1a2b3c4d5e6f): two different trees never share a version, so neither pip nor MLflow's
cache of model environments (keyed by the requirements' text) takes one for the other.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sala.home import sala_home

ROOT = Path(__file__).resolve().parents[1]


class WheelError(RuntimeError):
    """This project's wheel cannot be built from here; the message says why."""


def source_files(root: Path = ROOT) -> list[Path]:
    """What the wheel is built from: pyproject.toml, README.md (the wheel's description) and every
    top-level package directory, bytecode left out. pyproject.toml's package list picks from these."""
    if not (root / "pyproject.toml").is_file():
        raise WheelError(f"logging a model needs this project's source tree, and {root} has no pyproject.toml: "
                         "install the project from its checkout (pip install -e)")
    files = [root / "pyproject.toml", root / "README.md"]
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        files += sorted(f for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    return files


def source_hash(files: list[Path], root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:12]


def project_wheel(root: Path = ROOT) -> Path:
    """The wheel of the source tree at `root`; a tree already built returns the cached file."""
    files = source_files(root)
    digest = source_hash(files, root)
    cached = sala_home() / "wheels" / digest
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            src, out = Path(tmp, "src"), Path(tmp, "wheel")
            for f in files:
                (src / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, src / f.relative_to(root))
            pyproject = src / "pyproject.toml"
            text, n = re.subn(r'(?m)^version = "([^"+]+)"$', rf'version = "\1+src.{digest}"', pyproject.read_text(), count=1)
            if n != 1:
                raise WheelError(f"{root / 'pyproject.toml'} has no plain `version = \"...\"` line")
            pyproject.write_text(text)
            out.mkdir()
            # The PEP 517 hook of the installed setuptools: no index, no build environment to fetch.
            r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                                "build_meta.build_wheel(sys.argv[1])", str(out)], cwd=src, capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
                raise WheelError(f"building this project's wheel from {root} failed: {last}")
            try:
                out.rename(cached)
            except OSError:
                if not cached.is_dir():  # not a concurrent build of the same tree that finished first
                    raise
    (wheel,) = cached.glob("*.whl")
    return wheel
