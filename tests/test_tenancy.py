"""A server shared by several tenants, engine side: cache namespaces (cache_salt), the waiting
queue interleaved by tenant, SGLang's priority scheduling and preemption, and the intake's
checks of the new fields. The HTTP side (keys, shares, salts end to end) is test_server_tenants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import fake_step, make_req, make_scheduler, run_to_completion

from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.kvcache.namespaces import namespaced, salt_namespace

# ---------------------------------------------------------------- namespaces


@settings(max_examples=200, deadline=None)
@given(a=st.text(max_size=20), b=st.text(max_size=20),
       ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20))
def test_namespaces_never_share_a_key(a, b, ids):
    na, nb = salt_namespace(a), salt_namespace(b)
    assert na != 0 and na == salt_namespace(a)
    assert namespaced(ids, 0) == ids
    if a != b:
        assert na != nb  # 64-bit hashes: a collision here would be news
        assert set(namespaced(ids, na)).isdisjoint(namespaced(ids, nb))
    assert set(namespaced(ids, na)).isdisjoint(ids)


def _salted(ids: list[int], salt: str | None, max_new_tokens: int = 2):
    req = make_req(ids, max_new_tokens)
    req.cache_namespace = salt_namespace(salt)
    return req


def test_a_salted_prefix_is_shared_only_within_its_salt():
    sched = make_scheduler()
    prompt = list(range(100, 300))
    sched.waiting.append(_salted(prompt, "alice"))
    run_to_completion(sched)
    later = {salt: _salted(prompt + [7], salt) for salt in ("alice", "bob", None)}
    assert {salt: sched.kv.match_len(r) for salt, r in later.items()} == {
        "alice": 200, "bob": 0, None: 0}
    sched.waiting.extend(later.values())
    run_to_completion(sched)
    assert {salt: r.cached_tokens for salt, r in later.items()} == {
        "alice": 200, "bob": 0, None: 0}
    sched.kv.check_invariants([])


def test_requests_sharing_tokens_across_salts_do_not_wait_for_each_other():
    """The in-batch share rule (wait a step, then hit the cache) only applies within a salt:
    across salts there is nothing to hit, and waiting would tell one salt about the other."""
    sched = make_scheduler()
    prompt = list(range(500, 600))
    first, same, other = _salted(prompt, "a"), _salted(prompt + [1], "a"), _salted(prompt, "b")
    sched.waiting.extend([first, same, other])
    batch = sched.schedule()
    assert batch is not None and batch.reqs == [first, other]


# ---------------------------------------------------------------- tenants interleaved


def _tenant_req(tenant: str, i: int, priority: int = 0, max_new_tokens: int = 4):
    req = make_req(list(range(1000 * i + 1, 1000 * i + 11)), max_new_tokens)
    req.tenant, req.priority, req.rid = tenant, priority, f"{tenant}{i}"
    return req


def test_a_flooding_tenant_does_not_keep_another_waiting():
    sched = make_scheduler(max_running_requests=2, schedule_policy="fcfs")
    flood = [_tenant_req("flood", i) for i in range(6)]
    solo = _tenant_req("solo", 9)
    sched.waiting.extend([*flood, solo])  # solo arrives last
    batch = sched.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["flood0", "solo9"]
    fake_step(sched, batch)
    run_to_completion(sched)
    assert all(r.finished for r in [*flood, solo])


def test_one_tenant_keeps_the_policy_order():
    sched = make_scheduler(max_running_requests=3, schedule_policy="fcfs")
    reqs = [_tenant_req("", i) for i in range(5)]
    sched.waiting.extend(reversed(reqs))  # arrival order, not list order, decides fcfs
    batch = sched.schedule()
    assert batch is not None and batch.reqs == reqs[:3]


def test_a_tenant_with_requests_running_yields_to_one_without():
    sched = make_scheduler(max_running_requests=3, schedule_policy="fcfs")
    sched.waiting.extend([_tenant_req("a", 0, max_new_tokens=50),
                          _tenant_req("a", 1, max_new_tokens=50)])
    fake_step(sched, sched.schedule())
    later = [_tenant_req("a", 2), _tenant_req("b", 3)]
    sched.waiting.extend(later)
    batch = sched.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["b3"]


# ---------------------------------------------------------------- priorities


def test_priorities_order_the_queue_only_when_enabled():
    reqs = lambda: [_tenant_req("", i, priority=p) for i, p in enumerate([1, 5, 3])]  # noqa: E731
    for config, expected in [({}, ["0", "1", "2"]),
                             ({"enable_priority_scheduling": True}, ["1", "2", "0"]),
                             ({"enable_priority_scheduling": True,
                               "schedule_low_priority_values_first": True}, ["0", "2", "1"])]:
        sched = make_scheduler(max_running_requests=1, schedule_policy="fcfs", **config)
        sched.waiting.extend(reqs())
        order = []
        while sched.has_work:
            batch = sched.schedule()
            assert batch is not None
            order += [r.rid for r in batch.reqs if batch.phase == "prefill"]
            fake_step(sched, batch)
        assert order == expected, config


@pytest.mark.parametrize("urgency, preempted", [(10, True), (9, False)])
def test_an_urgent_request_preempts_the_least_urgent_running_one(urgency, preempted):
    sched = make_scheduler(max_running_requests=2, schedule_policy="fcfs",
                           enable_priority_scheduling=True)
    low, mid = _tenant_req("", 0, priority=0, max_new_tokens=30), _tenant_req("", 1, 5, 30)
    sched.waiting.extend([low, mid])
    fake_step(sched, sched.schedule())
    fake_step(sched, sched.schedule())  # both decoding
    urgent = _tenant_req("", 2, priority=urgency, max_new_tokens=3)
    sched.waiting.append(urgent)
    batch = sched.schedule()
    assert batch is not None
    if preempted:
        assert batch.reqs == [urgent] and low in sched.waiting and low.num_retractions == 1
    else:
        assert batch.phase == "decode" and urgent in sched.waiting
    fake_step(sched, batch)
    run_to_completion(sched)
    assert all(len(r.output_ids) == r.sampling_params.max_new_tokens for r in (low, mid, urgent))


# ---------------------------------------------------------------- intake


def test_intake_checks_and_applies_the_tenant_fields(make_engine):
    engine = make_engine()  # priority scheduling off: a priority is ignored
    group = engine.prepare(EngineRequest("Hi", cache_salt="s", priority=7, tenant="alice"))
    (req,) = group.reqs
    assert (req.cache_namespace, req.priority, req.tenant) == (salt_namespace("s"), 0, "alice")
    for field, value in [("cache_salt", ""), ("cache_salt", "x" * 1025), ("cache_salt", 3),
                         ("tenant", ""), ("priority", 2**31), ("priority", "high")]:
        with pytest.raises(InvalidArgumentError, match=field):
            engine.prepare(EngineRequest("Hi", **{field: value}))
    assert EngineRequest("Hi", cache_salt="s", priority=2).to_json()["cache_salt"] == "s"
    assert EngineRequest.from_call("Hi", priority=3, cache_salt="t").priority == 3
