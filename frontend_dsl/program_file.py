"""Load and run a program file: a Python file with an `@function` program, or a textual `.fl`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from forklm.frontend_dsl.interpreter import GraphProgram
from forklm.frontend_dsl.program import Program
from forklm.frontend_dsl.state import ProgramState
from forklm.frontend_dsl.textual import parse_program
from forklm.runtime.errors import InvalidArgumentError

TEXTUAL_SUFFIXES = (".fl",)


def load_program_file(path: str | Path, name: str | None = None) -> Program:
    """The program in `path`: a `.fl` file is parsed (never executed as Python); a `.py` file is
    imported and its `@function` program returned (the only one, or the one called `name`)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError("path", str(path), "no such program file")
    if path.suffix in TEXTUAL_SUFFIXES:
        return GraphProgram(parse_program(path.read_text(encoding="utf-8")))
    if path.suffix != ".py":
        raise InvalidArgumentError("path", str(path), f"expected a .py or {TEXTUAL_SUFFIXES} file")
    programs = _programs_in(path)
    if name is not None:
        if name not in programs:
            raise InvalidArgumentError("name", name, f"{path} defines programs {sorted(programs)}")
        return programs[name]
    if len(programs) != 1:
        raise InvalidArgumentError("path", str(path), f"defines {len(programs)} programs "
                                   f"{sorted(programs)}; choose one with name=")
    return next(iter(programs.values()))


def _programs_in(path: Path) -> dict[str, Program]:
    module_name = f"forklm_program_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    # programs defined in this file (not ones it imports from elsewhere)
    return {k: v for k, v in vars(module).items() if isinstance(v, Program) and (
        isinstance(v, GraphProgram) or v.func.__module__ == module_name)}


def run_program_file(path: str | Path, arguments: dict[str, str], backend: Any = None,
                     name: str | None = None, **defaults: Any) -> ProgramState:
    """Run the program in `path` with `arguments` (e.g. from `--arg k=v`) until it finishes."""
    program = load_program_file(path, name)
    unknown = sorted(set(arguments) - set(program.arg_names))
    if unknown:
        raise InvalidArgumentError(unknown[0], arguments[unknown[0]],
                                   f"not an argument of the program {program.arg_names}")
    state = program.run(backend=backend, **arguments, **defaults)
    state.sync()
    return state
