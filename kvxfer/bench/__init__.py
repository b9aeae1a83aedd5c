"""``kvxfer bench``: kvxfer against raw NIXL and the link limit, measured in one run (layer: bench app; may use all of kvxfer).

Entry point: ``kvxfer.bench.cli:main(argv) -> int``.
"""
