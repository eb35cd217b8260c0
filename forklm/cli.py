"""The `forklm` command line: `forklm generate PROMPT` streams an answer from the engine;
`forklm serve` runs the HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import forklm.startup as startup
from forklm.runtime.config import EngineConfig
from forklm.server.flags import add_engine_flags, add_serve_flags, dataclass_kwargs, engine_kwargs


def _generate(args: argparse.Namespace) -> int:
    from forklm.runtime.engine.engine import Engine
    from forklm.runtime.engine.engine_request import EngineRequest
    from forklm.runtime.sampling.params import SamplingParams

    with Engine(**engine_kwargs(args)) as engine:
        startup.started()
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        for chunk in engine.stream_outputs(EngineRequest(prompt, sampling_params=params)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from forklm.runtime.errors import InvalidArgumentError
    from forklm.server.config import ServerConfig
    from forklm.server.launch import serve

    logging.getLogger().setLevel(logging.INFO)
    try:
        engine_config = EngineConfig.from_kwargs(**engine_kwargs(args))
        server_config = ServerConfig.from_kwargs(**dataclass_kwargs(args, ServerConfig))
    except InvalidArgumentError as e:
        print(f"forklm serve: error: {e}", file=sys.stderr)
        return 2
    if args.ray:  # replicas as a Ray Serve deployment (forklm/ray_serve/); Ray is optional
        startup.started()
        return _serve_ray(args, server_config)
    if server_config.dp_size > 1:  # N replicas behind a router (forklm/router/)
        startup.started()
        from forklm.router.launch import serve_dp

        return serve_dp(engine_kwargs(args), server_config, dataclass_kwargs(args, ServerConfig))
    if engine_config.node_rank > 0:  # another machine's tensor-parallel ranks: no server here
        from forklm.runtime.distributed import run_worker_node

        startup.started()
        return run_worker_node(engine_config)
    return serve(engine_config, server_config)  # calls startup.started() once it is up


def _serve_ray(args: argparse.Namespace, server_config: Any) -> int:
    from forklm.ray_serve import require_ray

    try:
        require_ray()
    except ImportError as e:
        print(f"forklm serve: error: {e}", file=sys.stderr)
        return 2
    from forklm.ray_serve.launch import serve_ray

    return serve_ray(engine_kwargs(args), server_config)


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the HTTP server (native /generate and OpenAI API)")
    add_serve_flags(serve)
    serve.set_defaults(func=_serve)


def _run(args: argparse.Namespace) -> int:
    """Run a program file (Python `@function` or textual `.fl`) and print its variables."""
    import json

    from forklm.frontend_dsl.program_file import run_program_file
    from forklm.runtime.engine.engine import Engine
    from forklm.runtime.errors import ForkLMError

    arguments = {}
    for pair in args.arg:
        key, sep, value = pair.partition("=")
        if not sep:
            print(f"forklm run: error: --arg {pair!r} must look like key=value", file=sys.stderr)
            return 2
        arguments[key] = value
    defaults = {"temperature": args.temperature}
    if args.max_new_tokens is not None:
        defaults["max_new_tokens"] = args.max_new_tokens
    try:
        with Engine(**engine_kwargs(args)) as engine:
            startup.started()
            state = run_program_file(args.file, arguments, backend=engine, name=args.name,
                                     **defaults)
            variables = state.variables()
    except (ForkLMError, TypeError, ValueError, OSError) as e:
        print(f"forklm run: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(variables, indent=2, default=str))
    else:
        for name, value in variables.items():
            print(f"{name}: {value!r}")
    return 0


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="run a program file (.py with @function, or textual .fl)")
    run.add_argument("file")
    run.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                     help="a program argument (repeatable)")
    run.add_argument("--name", default=None, help="which program, if the file defines several")
    run.add_argument("--temperature", type=float, default=0.0, help="run default (greedy: 0)")
    run.add_argument("--max-new-tokens", type=int, default=None, help="run default for gens")
    run.add_argument("--json", action="store_true", help="print the variables as JSON")
    add_engine_flags(run)
    run.set_defaults(func=_run)


def _bench(bench_args: list[str]) -> int:
    """`forklm bench ARGS` is `python -m benchmarks ARGS`, run from a source checkout (the suite
    ships with the repository, not the installed package)."""
    import os
    import runpy

    if not os.path.isfile(os.path.join("benchmarks", "__main__.py")):
        print("forklm bench: error: run it from the forklm repository root (benchmarks/ is not "
              "part of the installed package)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())
    sys.argv = ["forklm bench", *bench_args]
    runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """What this machine gives forklm: the CPU level, which native kernels load and from where
    (prebuilt, compiled here, or off and why), and the dtype `auto` picks."""
    import platform

    import torch

    from forklm.kernels.cpu import bindings, native_build
    from forklm.runtime.config import resolved_dtype_name

    level = native_build.best_level()
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{platform.machine()}, {torch.get_num_threads()} torch threads")
    print(f"CPU level: {level.name if level else 'none known for this architecture'}; "
          f"dtype auto -> {resolved_dtype_name('auto')}")
    off = 0
    for name, state in bindings.status().items():
        print(f"  {name:18s} {state}")
        off += state.startswith("off: no native library")
    if off:
        print("Some kernels fell back to torch (2-3x slower per token): install forklm from "
              "a wheel, or a C compiler (GCC 12+ or clang) for a source checkout.")
    return 1 if off else 0


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
    _add_serve(sub)
    _add_run(sub)
    doctor = sub.add_parser("doctor", help="which native kernels this machine runs, and why not")
    doctor.set_defaults(func=_doctor)
    # listed for --help only: main() hands everything after `bench` to the suite's own parser
    sub.add_parser("bench", help="the benchmark suite (forklm bench --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["serve"], ["run"], ["generate"], ["bench"]):
        from forklm.runtime.process_heap import tune_heap

        tune_heap()  # before a second thread exists (runtime/process_heap.py)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    # the collector off while the commands' modules load (the parser's flags import the server
    # and engine stacks) and an engine builds; each long-running command calls started()
    startup.pause_collection()
    try:
        args = build_parser().parse_args(argv)
        from forklm.runtime.errors import ModelNotFoundError

        try:
            return args.func(args)
        except ModelNotFoundError as e:  # a model that cannot be found or run: say why
            print(f"forklm {args.command}: error: {e}", file=sys.stderr)
            return 2
    finally:  # a command that ends, or fails, before its start-up is over
        startup.resumed()


if __name__ == "__main__":
    sys.exit(main())
