"""Start-up (issue 39): what an engine on a cached GGUF must not import, since each costs a large
share of the time from launch to ready (benchmarks/startup.py measures it): a family's
transformers config class (it pulls transformers' model-loading stack and torch.distributed,
~0.9 s), torch._dynamo (~0.5 s) and xgrammar (~0.4 s, until the first constrained request or a
server's warm-up thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from forklm.runtime.engine.engine import Engine

HEAVY_MODULES = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor",
                 "torch._dynamo", "xgrammar")
_PROBE = f"""
import json, sys
from forklm import Engine
engine = Engine(max_total_tokens=2048)
out = engine.generate("Hello", {{"max_new_tokens": 2, "temperature": 0}})
print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))
engine.shutdown()
"""


def _imported_by_a_fresh_engine(cache_dir: str) -> list[str]:
    env = {**os.environ, "FORKLM_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_on_a_cached_gguf_skips_the_heavy_imports(tmp_path):
    _imported_by_a_fresh_engine(str(tmp_path))  # the first load writes the cache
    assert _imported_by_a_fresh_engine(str(tmp_path)) == []


def test_grammar_warm_up_readies_the_compiler_once(make_engine):
    engine: Engine = make_engine()
    grammar = engine.parts.grammar
    grammar.warm_up()
    compiler = grammar._compiler
    assert compiler is not None
    grammar.warm_up()
    assert grammar._compiler is compiler
    out = engine.generate("Pick one:", {"max_new_tokens": 8, "temperature": 0,
                                                "regex": "(yes|no)"})
    assert out["text"] in ("yes", "no")
