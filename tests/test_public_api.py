"""The public API: a curated, sorted __all__ whose every name resolves."""

import kvxfer


def test_all_is_sorted_and_resolves():
    names = [n for n in kvxfer.__all__ if n != "__version__"]
    assert names == sorted(names)
    for name in kvxfer.__all__:
        assert getattr(kvxfer, name) is not None


def test_errors_share_one_base():
    for name in kvxfer.__all__:
        obj = getattr(kvxfer, name)
        if isinstance(obj, type) and name.endswith("Error"):
            assert issubclass(obj, kvxfer.KvxferError)
