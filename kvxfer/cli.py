"""The ``kvxfer`` command (layer: app): ``kvxfer demo | bench | proxy | version``."""

from __future__ import annotations

import sys

USAGE = """usage: kvxfer <command> [args]

commands:
  demo     two processes move a model-shaped KV cache over NIXL and verify every byte
  bench    measure kvxfer against raw NIXL (and torch peer copy on GPUs)
  proxy    run the P/D routing proxy (OpenAI-compatible)
  version  print the version
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command == "version":
        from kvxfer import __version__

        print(__version__)
        return 0
    if command == "demo":
        from kvxfer.demo import main as run
    elif command == "bench":
        from kvxfer.bench.cli import main as run
    elif command == "proxy":
        from kvxfer.proxy.cli import main as run
    else:
        print(f"kvxfer: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
