"""SwitchInterval: the serving process's CPython switch interval as io.gil_switch_interval_ms sets it."""

import sys

import pytest

from sglang_cp.l3.switch_interval import SwitchInterval


@pytest.fixture(autouse=True)
def keep_the_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_zero_leaves_the_interpreter_alone():
    sys.setswitchinterval(0.004)
    s = SwitchInterval(0.0)
    assert sys.getswitchinterval() == 0.004 and s.set_s is None
    s.restore()
    assert sys.getswitchinterval() == 0.004


def test_set_at_open_and_put_back_at_close():
    sys.setswitchinterval(0.005)
    s = SwitchInterval(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.0005) and s.before_s == 0.005
    s.restore()
    assert sys.getswitchinterval() == 0.005
    s.restore()  # idempotent
    assert sys.getswitchinterval() == 0.005


def test_a_value_someone_set_since_is_kept():
    """Another owner (a second store, the application) changed it after us: closing does not undo theirs."""
    sys.setswitchinterval(0.005)
    s = SwitchInterval(0.5)
    sys.setswitchinterval(0.002)
    s.restore()
    assert sys.getswitchinterval() == 0.002
