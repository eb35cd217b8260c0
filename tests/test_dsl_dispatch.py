"""Every node kind is known to every concern that dispatches on it: the executor or the
interpreter runs it, it labels itself, the JSON codec round-trips it; and a program appends only
what the executor runs."""

from __future__ import annotations

import asyncio

import pytest
from test_dsl_fake_backend import FakeBackend

import forklm as sgl
from forklm.frontend_dsl import interpreter, ir
from forklm.frontend_dsl.executor import appendable, drive, handles
from forklm.frontend_dsl.ir_codec import node_from_dict, node_to_dict

# One node of each kind, with its label in the text dump.
EXAMPLES: dict[str, tuple[ir.Node, str]] = {
    "text": (ir.Text("hi"), 'text("hi")'),
    "arg": (ir.Arg("q"), "arg(q)"),
    "gen": (ir.Gen("a", {"max_new_tokens": 3}, dtype="int"),
            'gen("a", max_new_tokens=3, dtype=int)'),
    "select": (ir.Select("v", ["y", "n"]), 'select("v", choices=["y", "n"])'),
    "role_begin": (ir.RoleBegin("user"), "role_begin(user)"),
    "role_end": (ir.RoleEnd("user"), "role_end(user)"),
    "scope_begin": (ir.ScopeBegin("s"), 'scope_begin("s")'),
    "scope_end": (ir.ScopeEnd("s"), 'scope_end("s")'),
    "read": (ir.Read("a", [0, 1]), 'read("a", of=%0[1])'),
    "set": (ir.SetVar("x", "q", "arg"), 'set("x", arg="q")'),
    "fork": (ir.Fork(2, [[ir.Text("a")], []]), "fork(2)"),
    "join": (ir.Join(0, "concate_and_append"), 'join(%0, mode="concate_and_append")'),
    "if": (ir.If("v", "y", [ir.Text("a")]), 'if(v == "y")'),
    "repeat": (ir.Repeat(3, [ir.Break()]), "repeat(3)"),
    "break": (ir.Break(), "break"),
}


def test_the_examples_cover_every_node_kind():
    assert set(EXAMPLES) == set(ir.NODE_TYPES)


@pytest.mark.parametrize("op", sorted(ir.NODE_TYPES))
def test_each_node_kind_is_run_labelled_and_encoded(op):
    node, label = EXAMPLES[op]
    cls = ir.NODE_TYPES[op]
    assert handles(cls) or cls in interpreter._STEPS, f"nothing runs {op}"
    assert not appendable(node) or handles(cls), f"{op} can be appended but never runs"
    assert node.label() == label
    assert node_from_dict("n", node_to_dict(node)) == node


def test_structure_nodes_cannot_be_appended():
    for op in ("arg", "read", "fork", "join", "if", "repeat", "break"):
        with pytest.raises(ValueError, match="cannot append"):
            sgl.function(lambda s, node=EXAMPLES[op][0]: s.__iadd__(node)).run(
                backend=FakeBackend()).sync()


def test_drive_refuses_a_coroutine_that_suspends():
    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(AssertionError, match="suspends"):
        drive(suspends())


def test_an_async_join_after_the_program_failed_raises_its_error():
    """A fork and join queued once the program has failed fail with its error (they used to
    wait forever)."""
    seen: list[BaseException] = []

    @sgl.function
    async def failing(s):
        s += sgl.user_end()  # no matching begin: the program fails here
        with pytest.raises(ValueError):
            await s.sync()
        forks = s.fork(2)
        forks += "x"
        try:
            await forks.join()
        except ValueError as e:
            seen.append(e)

    state = asyncio.run(asyncio.wait_for(failing.run_async(backend=FakeBackend()), 10))
    assert len(seen) == 1 and "user_end without a matching" in str(seen[0])
    with pytest.raises(ValueError, match="user_end"):
        state.text()
