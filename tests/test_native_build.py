"""Native kernels built ahead of time (kernels/cpu/native_build.py): each CPU gets the best level
it runs, a process without a compiler loads them, a library built from other sources is never
used, and with neither a prebuilt library nor a compiler the fallback is a WARNING that names
the cost and the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from forklm.kernels.cpu import native_build

STATUS = ("import json, logging; logging.basicConfig(format='%(levelname)s %(message)s'); "
          "from forklm.kernels.cpu import bindings; print(json.dumps(bindings.status()))")


def _status(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """bindings.status() in a fresh process under `env` (and its stderr)."""
    done = subprocess.run([sys.executable, "-c", STATUS], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_each_cpu_gets_the_best_level_it_runs():
    if native_build.levels() != native_build.X86_LEVELS:
        pytest.skip("the x86-64 levels")  # an aarch64 machine has one level
    v3 = native_build.X86_LEVELS[2].needs
    v4 = native_build.X86_LEVELS[1].needs
    assert native_build.best_level(frozenset()).name == "x86_64"
    assert native_build.best_level(v3).name == "avx2"
    assert native_build.best_level(v4).name == "avx512"
    assert native_build.best_level(v4 | {"avx512_vnni", "avx512_bf16"}).name == "avx512_vnni_bf16"
    assert native_build.best_level(v4 | {"avx512_vnni"}).name == "avx512"  # no bf16: not that one


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """This CPU's level and the plain x86-64 one in a folder of their own: copied from the
    checkout's prebuilt folder where `make setup` built them from the current sources (building
    them again takes ~20 s), else built here."""
    level = native_build.best_level()
    if level is None:
        pytest.skip("no instruction-set levels for this architecture")
    out = tmp_path_factory.mktemp("prebuilt")
    names = {level.name, native_build.levels()[-1].name}
    manifest = (_copy_current(native_build.PREBUILT_DIR, out, names)
                or native_build.build_prebuilt(out, only=tuple(names)))
    assert {entry["level"] for entry in manifest.values()} == names
    return out, level


def _copy_current(source, out, names: set[str]) -> dict | None:
    """Copy every library of the levels `names` from `source` into `out`, with their manifest,
    when all were built from the current sources (native_build.prebuilt_library finds each for
    a CPU of exactly that level); None (nothing copied) otherwise."""
    wanted = []
    for stem in native_build.LIBRARIES:
        for level in native_build.levels():
            if level.name in names:
                found = native_build.prebuilt_library(stem, source, level.needs)
                if found is None or found[1] != level.name:  # missing, or from older sources
                    return None
                wanted.append(f"{stem}-{level.name}")
    for key in wanted:
        shutil.copy(source / f"{key}.so", out / f"{key}.so")
    manifest = json.loads((source / native_build.MANIFEST).read_text())
    copied = {key: manifest[key] for key in wanted}
    (out / native_build.MANIFEST).write_text(json.dumps(copied))
    return copied


def test_a_process_without_a_compiler_loads_the_prebuilt_kernels(prebuilt, tmp_path):
    out, level = prebuilt
    status, _ = _status({"PATH": str(tmp_path), "FORKLM_PREBUILT_DIR": str(out),
                         "FORKLM_CACHE_DIR": str(tmp_path / "cache")})
    assert status == {name: f"prebuilt for {level.name}" for name in status}, status
    assert not (tmp_path / "cache").exists()  # nothing compiled, not even `cc --version` run


def test_the_prebuilt_kernels_compute_what_their_torch_twins_do(prebuilt, tmp_path):
    out, level = prebuilt
    check = ("import torch; from forklm.kernels.cpu import bindings; "
             "x = torch.randn(5, 1000); x[3, 17] = 9.0; "
             "assert bindings.greedy_pick(x).tolist() == x.argmax(1).tolist(); "
             "print(bindings.status()['greedy pick'])")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PATH": str(tmp_path),
                                            "FORKLM_PREBUILT_DIR": str(out)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"prebuilt for {level.name}"


def test_a_library_built_from_other_sources_is_never_used(prebuilt, tmp_path):
    out, level = prebuilt
    stale = tmp_path / "stale"
    stale.mkdir()
    for path in out.iterdir():
        (stale / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((stale / native_build.MANIFEST).read_text())
    manifest[f"greedy_pick-{level.name}"]["key"] = "0" * 64  # as if greedy_pick.c changed since
    (stale / native_build.MANIFEST).write_text(json.dumps(manifest))
    assert native_build.prebuilt_library("greedy_pick", stale)[1] == "x86_64"  # the next level
    assert native_build.prebuilt_library("paged_attention", stale)[1] == level.name
    assert native_build.prebuilt_library("greedy_pick", tmp_path) is None  # no manifest


def test_no_prebuilt_library_and_no_compiler_is_a_warning_naming_the_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    status, stderr = _status({"PATH": str(tmp_path), "FORKLM_PREBUILT_DIR": str(empty),
                              "FORKLM_CACHE_DIR": str(tmp_path / "cache")})
    assert all(state.startswith("off: no native library") for state in status.values()), status
    assert "no C compiler" in status["paged attention"]
    assert "WARNING" in stderr and "2-3x slower" in stderr and "forklm doctor" in stderr


def test_forklm_doctor_reports_each_kernel(prebuilt, tmp_path):
    out, level = prebuilt
    done = subprocess.run([sys.executable, "-m", "forklm", "doctor"], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "FORKLM_PREBUILT_DIR": str(out)})
    assert done.returncode == 0, done.stderr
    assert f"CPU level: {level.name}" in done.stdout
    assert done.stdout.count(f"prebuilt for {level.name}") == len(native_build.LIBRARIES)


WIDEN_CHECK = """
import torch
from forklm.kernels.cpu import bindings
from forklm.runtime.kvcache.pool import KVPool
assert bindings.status()['paged attention'] == 'prebuilt for x86_64', bindings.status()
torch.manual_seed(0)
q = torch.randn(3, 4, 64)
for kv_dtype in (torch.float8_e5m2, torch.float8_e4m3fn, torch.int8):
    pool = KVPool(1, 40, 2, 64, torch.float32, kv_dtype=kv_dtype)
    k, v = torch.randn(40, 2, 64) * 3, torch.randn(40, 2, 64)
    k[0, 0, :8] = 1e-5  # subnormal in both 8-bit float formats
    pool.store(0, torch.arange(40), k, v)
    table = torch.randperm(40)[None].repeat(3, 1).contiguous()
    out = torch.empty_like(q)
    scales = (None, None) if pool.k_scale is None else (pool.k_scale[0], pool.v_scale[0])
    bindings.paged_attention(q, pool.k_buffer[0], pool.v_buffer[0], out, table,
                             torch.zeros(3, dtype=torch.int64), torch.tensor([40, 17, 1]),
                             0.125, None, None, None, None, *scales)
    for t, end in enumerate((40, 17, 1)):
        idx = table[0, :end]
        keys = pool.read_k(0, idx).double().repeat_interleave(2, 1)
        values = pool.read_v(0, idx).double().repeat_interleave(2, 1)
        p = (torch.einsum('hd,nhd->hn', q[t].double(), keys) * 0.125).softmax(-1)
        want = torch.einsum('hn,nhd->hd', p, values)
        torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-5)
print('ok')
"""


def test_the_plain_x86_64_kernels_widen_8_bit_pools(prebuilt, tmp_path):
    """The portable paths of the 8-bit KV formats (no F16C, no AVX2: the fp8 bits built in
    integers, int8 codes widened one by one), loaded as a CPU without AVX would load them,
    against a float64 reference over the pool's own widened rows."""
    out, _ = prebuilt
    plain = tmp_path / "plain"
    plain.mkdir()
    manifest = {name: entry for name, entry in
                json.loads((out / native_build.MANIFEST).read_text()).items()
                if entry["level"] == "x86_64"}
    for name in manifest:
        (plain / f"{name}.so").write_bytes((out / f"{name}.so").read_bytes())
    (plain / native_build.MANIFEST).write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-c", WIDEN_CHECK], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PATH": str(tmp_path),
                                            "FORKLM_PREBUILT_DIR": str(plain)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
