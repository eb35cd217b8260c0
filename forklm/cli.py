"""The `forklm` command line: `forklm generate PROMPT` streams an answer from the engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from typing import Any

from forklm.runtime.config import EngineConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-total-tokens, ...), generated from the dataclass."""
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=kind, default=None,
                                help=f"(default: {field.default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _base_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _generate(args: argparse.Namespace) -> int:
    from forklm.runtime.engine import Engine

    with Engine(**engine_kwargs(args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        for chunk in engine.generate(prompt, params, stream=True):
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forklm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_engine_flags(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
