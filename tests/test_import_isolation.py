"""A checkout never stands in for an installed distribution. Python started at the repository
root (`python -m pytest`, `python -m forklm ...`, `python -c ...`, a notebook) has the root first
on sys.path; transformers 5 imports Hugging Face's `kernels`, and the root's own kernels/ folder
once answered that import instead. The root holds regular packages only under names no installed
distribution uses, and forklm's children start with their working directory off sys.path."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT

from forklm.runtime.child_process import forklm_command


def _importable_from_root() -> set[str]:
    """Top-level names that `import NAME` would find in the repository root itself: modules and
    regular packages (a folder without __init__.py is at most a namespace portion, which any
    installed package of the same name takes precedence over)."""
    names = {p.stem for p in REPO_ROOT.glob("*.py")}
    names |= {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    return names


def _run_at_root(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_no_root_package_is_named_like_an_installed_distribution() -> None:
    provided = importlib.metadata.packages_distributions()
    clashes = {name: provided[name] for name in _importable_from_root()
               if name in provided and set(provided[name]) != {"forklm"}}
    assert not clashes, f"these repository-root packages shadow installed ones: {clashes}"


def test_the_kernels_folder_is_not_a_package() -> None:
    assert (REPO_ROOT / "kernels").is_dir() and "kernels" not in _importable_from_root()


def test_python_started_at_the_root_imports_the_installed_kernels(tmp_path: Path) -> None:
    """A stand-in `kernels` distribution on PYTHONPATH (after the root on sys.path, as
    site-packages is) is what `import kernels` finds at the root, whether or not Hugging Face's
    is installed here."""
    stand_in = tmp_path / "site" / "kernels"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("STAND_IN = True\n")
    done = _run_at_root("import kernels; print(getattr(kernels, 'STAND_IN', kernels.__path__))",
                        pythonpath=tmp_path / "site")
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stdout + done.stderr


def test_transformers_imports_at_the_root() -> None:
    """The failure users met: transformers.activations imports `kernels` (transformers >= 5)."""
    done = _run_at_root("import transformers.activations, forklm.kernels.triton; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_forklm_children_do_not_import_from_their_working_directory(tmp_path: Path) -> None:
    """A child started by forklm_command in a folder holding its own `forklm/` imports the
    forklm this process imports, not that folder's."""
    impostor = tmp_path / "forklm"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("raise SystemExit('the working directory was imported')\n")
    (impostor / "__main__.py").write_text("raise SystemExit('the working directory was imported')\n")
    done = subprocess.run(forklm_command("serve", "--help"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "--model-path" in done.stdout, done.stderr[-2000:]
