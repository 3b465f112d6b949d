import pytest

from ckpttools.errors import UsageError
from ckpttools.io import threads


def test_default_is_this_processs_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert threads.default_workers({}) == threads.MAX_DEFAULT
    assert threads.default_workers({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert threads.default_workers({"LOCAL_WORLD_SIZE": "32"}) == 1
    assert threads.default_workers({"LOCAL_WORLD_SIZE": "x"}) == threads.MAX_DEFAULT


def test_set_workers_is_the_process_wide_choice():
    try:
        threads.set_workers(3)
        assert threads.default_workers({"LOCAL_WORLD_SIZE": "64"}) == 3 == threads.resolve_workers(None)
        assert threads.resolve_workers(5) == 5
        with pytest.raises(UsageError, match="give 1 to 1024"):
            threads.set_workers(0)
        with pytest.raises(UsageError, match="give 1 to 1024"):
            threads.set_workers(5000)
    finally:
        threads.set_workers(None)
    assert threads.resolve_workers(None) == threads.default_workers()


def test_run_does_every_part_and_raises_the_first_error():
    done = []
    with threads.Workers(3) as pool:
        pool.run([lambda i=i: done.append(i) for i in range(5)])
        assert sorted(done) == [0, 1, 2, 3, 4]

        def boom():
            raise ValueError("part 2")

        with pytest.raises(ValueError, match="part 2"):
            pool.run([lambda: None, lambda: None, boom])
        pool.run([lambda: done.append(9)])  # still usable after an error
    assert done[-1] == 9


def test_the_whole_node_while_the_other_ranks_wait(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert threads.default_workers() == 2
    with threads.whole_node():
        assert threads.default_workers() == 6
    assert threads.default_workers() == 2
    threads.set_workers(1)
    try:
        with threads.whole_node():
            assert threads.default_workers() == 1  # the user's choice stays
    finally:
        threads.set_workers(None)
