"""The run's order of the modules that use the session's live servers (``tests/live_order.py``), on
made-up suites run by pytest itself (pytester), and the suite's own modules declaring what they do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONFTEST = """
import pytest
from live_order import order_by_live_servers

@pytest.fixture(scope="session")
def live():
    return "servers"

@pytest.fixture
def live_stopped(live):
    return live

def pytest_collection_modifyitems(items):
    order_by_live_servers(items)
"""

INI = """
[pytest]
markers = live_servers(how): test
"""


def _collected(pytester: pytest.Pytester) -> list[str]:
    run = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    assert run.ret == 0, run.stdout.str()
    return [line for line in run.stdout.lines if "::" in line]


def test_modules_run_by_how_they_use_the_session_servers_whole_and_stably(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(
        test_a_own="""
            import pytest
            pytestmark = pytest.mark.live_servers("own")
            @pytest.fixture(scope="module")
            def mine(live):
                return live
            def test_one(mine): pass
            def test_two(): pass
        """,
        test_b_shared="""
            def test_one(live): pass
        """,
        test_c_plain="""
            def test_one(): pass
            def test_two(): pass
        """,
        test_d_extra="""
            import pytest
            pytestmark = pytest.mark.live_servers("extra")
            def test_one(live): pass
        """,
        test_e_stopped="""
            def test_one(): pass
            def test_two(live_stopped): pass
            def test_three(): pass
        """,
        test_f_keeps="""
            import pytest
            pytestmark = pytest.mark.live_servers("own-but-prm")
            def test_one(live): pass
        """,
        test_g_shared="""
            def test_one(): pass
            def test_two(live): pass
            def test_three(): pass
        """,
        test_h_plain="""
            def test_one(): pass
        """,
    )
    assert _collected(pytester) == [
        "test_c_plain.py::test_one", "test_c_plain.py::test_two", "test_h_plain.py::test_one",
        "test_d_extra.py::test_one",
        "test_b_shared.py::test_one",
        "test_g_shared.py::test_one", "test_g_shared.py::test_two", "test_g_shared.py::test_three",
        "test_f_keeps.py::test_one",
        "test_a_own.py::test_one", "test_a_own.py::test_two",
        "test_e_stopped.py::test_one", "test_e_stopped.py::test_two", "test_e_stopped.py::test_three",
    ]


def test_a_marker_that_says_nothing_known_stops_the_run_naming_the_test(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_x="""
        import pytest
        @pytest.mark.live_servers("sometimes")
        def test_one(live): pass
    """)
    run = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    assert ("test_x.py::test_one: the live_servers marker takes one of extra, shared, own-but-prm, own; "
            "got ('sometimes',)") in run.stderr.str()


TESTS = Path(__file__).parent


def _declared(text: str) -> str | None:
    found = re.search(r'pytest\.mark\.live_servers\("([a-z-]+)"\)', text)
    return found and found.group(1)


def test_the_suites_modules_that_stop_session_servers_say_so():
    """A module that stops every session server (``live.stop(*...)``) to start its own must run
    after the sharing ones, and one that stops only the extras it started before them; else the
    order quietly restarts servers again."""
    seen = {}
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        if "live.stop(*(set(live.running()) - {\"prm\"}))" in text:
            seen[path.name] = ("own-but-prm", _declared(text))
        elif "live.stop(*live.running())" in text:
            seen[path.name] = ("own", _declared(text))
        elif re.search(r'live\.stop\("', text):
            seen[path.name] = ("extra", _declared(text))
    assert seen and all(want == got for want, got in seen.values()), seen
    assert {name for name, (want, _) in seen.items() if want == "extra"} == {
        "test_live_cpu_attention.py", "test_live_sparse_attention.py"}
