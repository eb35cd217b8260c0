"""The package build's one custom step: the native CPU kernels compiled per instruction-set level
into the wheel (kernels/cpu/native_build.py), so that installing it needs no compiler. Everything
else is in pyproject.toml. FORKLM_SKIP_NATIVE_BUILD=1 leaves them out (the kernels then compile
at first use where a compiler is)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        # An editable install maps the source tree: `make setup` builds kernels/cpu/prebuilt/.
        if getattr(self, "editable_mode", False) or os.environ.get("FORKLM_SKIP_NATIVE_BUILD"):
            return
        spec = importlib.util.spec_from_file_location(
            "native_build", Path(__file__).parent / "kernels" / "cpu" / "native_build.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        out = Path(self.build_lib) / "forklm" / "kernels" / "cpu" / "prebuilt"
        try:
            module.build_prebuilt(out)
        except RuntimeError as e:  # no compiler: a pure wheel whose kernels compile at first use
            print(f"native kernels not prebuilt: {e}")


class PlatformDistribution(Distribution):
    """A wheel holding compiled libraries is tagged for its platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
