"""A read that ends forgets only its own producer entry: a retry of the same request id, submitted
between the first read's end and its end-of-read bookkeeping, keeps its entry, so that
``abort(request_id)`` without a ``remote`` still tells its producer. Before, the entry was
dropped by request id, whichever read had put it there."""

from types import SimpleNamespace

from kvxfer.agent.parts import ReadRemotes


def _handle(request_id: str):
    return SimpleNamespace(request_id=request_id)


def test_an_ended_read_leaves_a_newer_read_of_its_id_in_place():
    remotes = ReadRemotes()
    first, retry = _handle("r"), _handle("r")
    remotes.add("r", ("10.0.0.1", 5600), first)
    remotes.add("r", ("10.0.0.2", 5600), retry)   # the retry, submitted once the first had ended
    remotes.forget([first])                        # the first read's bookkeeping runs late
    assert remotes.get("r") == ("10.0.0.2", 5600)
    assert remotes.hosts() == {"10.0.0.2"}
    remotes.forget([retry])
    assert remotes.get("r") is None
    assert remotes.hosts() == set()


def test_reads_of_other_ids_are_untouched():
    remotes = ReadRemotes()
    a, b = _handle("a"), _handle("b")
    remotes.add("a", ("h", 1), a)
    remotes.add("b", ("h", 2), b)
    remotes.forget([a])
    assert remotes.get("a") is None and remotes.get("b") == ("h", 2)
