import pytest

from suite_helpers import REPO, run_py  # noqa: F401  (kept importable from here)

# `make test` runs the suite on pytest-xdist workers with --dist loadgroup: a test goes to any idle worker,
# except that tests of one xdist_group all run on one worker. Groups are made here for two reasons.
#
# Host-wide resources: two workers raising and restoring vm.nr_hugepages at once would shrink each other's
# reservation, and doctor reads every hugetlbfs mount of the host (another worker's mount, or the stale
# slabs a test leaves on it, would change its table). Tests that use these fixtures join the group here;
# a test that reads the state without them marks itself (`pytest.mark.xdist_group("hugepages")`).
HOST_WIDE_FIXTURES = {
    "hugepages_2m": "hugepages",      # unit/l2: raises vm.nr_hugepages, mounts hugetlbfs
    "hugetlbfs_mount": "hugepages",   # integration/test_l2_host_pool_hook.py
    "hugetlbfs": "hugepages",         # gpu/ (skipped without CUDA)
}


def _group_name(text: str) -> str:
    """pytest-xdist finds a test's group after the last '@' of its node id, if no ']' follows."""
    return text.translate(str.maketrans("@[]", "___"))


def _shared_fixture_group(item):
    """The tests that share a module- or class-scoped fixture value with this one (many modules start
    all their processes in one module fixture, each test asserting on its own run): one group per module
    and per parameter of such fixtures, so the fixture runs once, not once on every worker. None when
    the test uses no such fixture."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info else {}
    shared = sorted(n for n in item.fixturenames if defs.get(n) and defs[n][-1].scope in ("class", "module", "package"))
    if not shared:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    tags = "".join(f":{n}={params[n]!r}" for n in shared if n in params)
    return _group_name(item.nodeid.split("::")[0] + tags)


def _groups(item) -> list:
    return sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                   for m in item.iter_markers("xdist_group")})


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # first: pytest-xdist reads the marks in its own hook, inside this wrapper
        if _groups(item):
            continue  # marked where it is written (with every test of its module that shares its fixtures)
        groups = {HOST_WIDE_FIXTURES[f] for f in item.fixturenames if f in HOST_WIDE_FIXTURES}
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid}: needs two host-wide xdist groups {sorted(groups)}")
        group = groups.pop() if groups else _shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        _check_group_suffixes(items)
    return result


def _check_group_suffixes(items):
    """A worker tells the controller a test's group only as the suffix '@<group>' of its node id, which
    pytest-xdist 3.8 writes into ``item._nodeid``; pytest 9.2 keeps the id in ``item._id`` (a NodeId) and
    no longer reads that field, so every group would silently be split across workers. Write the suffix
    where this pytest reads it; fail the run if it still does not show."""
    for item in items:
        groups = _groups(item)
        if not groups:
            continue
        suffix = "@" + "_".join(groups)
        if not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        if not item.nodeid.endswith(suffix):
            raise pytest.UsageError(f"{item.nodeid}: pytest-xdist did not put it in its group {suffix[1:]!r}; "
                                    "this pytest/pytest-xdist pair cannot run `make test` (see test/conftest.py)")


@pytest.fixture
def disk_tmp(tmp_path_factory):
    """A temp dir on a real disk filesystem (O_DIRECT works there; tmpfs would not)."""
    return tmp_path_factory.mktemp("disk")
