"""Command-line flags generated from the config dataclasses: one per EngineConfig and ServerConfig
field, for `forklm serve`, `forklm generate` and Ray Serve's application builder alike."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from forklm.runtime.config import EngineConfig


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """`forklm serve`'s flags: --model, --ray, then every ServerConfig and EngineConfig field."""
    from forklm.server.config import ServerConfig

    parser.add_argument("--model", dest="model_path", default=None,
                        help="model name or path (same as --model-path)")
    parser.add_argument("--ray", action="store_true",
                        help="run --dp-size engine replicas as a Ray Serve deployment (joins "
                        "RAY_ADDRESS if set); needs pip install 'forklm[ray]'")
    add_dataclass_flags(parser, ServerConfig)
    add_engine_flags(parser)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-total-tokens, ...), generated from the dataclass."""
    add_dataclass_flags(parser, EngineConfig)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dataclass_kwargs(args, EngineConfig)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`; unset flags stay None (= the field default)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(kind) is tuple:  # e.g. --lora-paths a=/x b=/y
            parser.add_argument(flag, type=typing.get_args(kind)[0], nargs="+", default=None,
                                help=f"(default: {field.default})")
        else:
            parser.add_argument(flag, type=kind, default=None,
                                help=f"(default: {field.default})")


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _base_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
