"""The driver's loop acts on a call as soon as it finishes, not when its wait times out.

Matches are always playing, so a wait for every pending call ran to its timeout each time, and a
learner's finished step was answered up to `WAIT_S` late (a CPU learner idled 90% of a run). Here the
timeout is made ten minutes: a loop that waits for everything has not answered after 30 seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from diprl.run import driver


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    from diprl.raysession import ray_session

    with ray_session(address="local", num_cpus=2):
        yield


def test_a_finished_call_is_returned_while_others_still_run(ray_local: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self) -> None:
            self.opened = threading.Event()

        def wait(self) -> str:
            self.opened.wait()
            return "late"

        def open(self) -> None:
            self.opened.set()

        def quick(self) -> str:
            return "quick"

    monkeypatch.setattr(driver, "WAIT_S", 600.0)
    gate = Gate.options(max_concurrency=4).remote()  # type: ignore[attr-defined]
    slow = gate.wait.remote()
    fast = [gate.quick.remote(), gate.quick.remote()]
    ray.get(fast)  # both have finished before the driver looks
    answers: list[list[object]] = []
    looking = threading.Thread(target=lambda: answers.append(driver._finished([slow, *fast])), daemon=True)
    looking.start()
    looking.join(30)  # a wait for every call would sit here until the slow one (or WAIT_S) ends
    gate.open.remote()
    assert answers, "the driver waited for every pending call instead of returning the finished ones"
    assert sorted(answers[0], key=fast.index) == fast
    assert ray.get(slow) == "late"
