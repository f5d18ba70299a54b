"""replayjob: trustworthy systems experiments on RL post-training of LoRA adapters.

Usage:
  replayjob init <dir> [--seed N]
  replayjob train <config> [--out DIR] [--set KEY=VALUE]...
  replayjob (-h | --help)
  replayjob --version

Commands:
  init       Write an initial resume state and example configs into <dir>.
  train      Run the source trainer (training.trainer = "grpo").

Options:
  --seed N          Seed for the initial adapter and the example configs [default: 123].
  --out DIR         Output directory (default: logging.dir from the config).
  --set KEY=VALUE   Override a config key; VALUE is read as TOML (7, true, "x", [1, 2]).
  -h --help         Show this help.
  --version         Show the version.

Exit codes: 0 pass, 1 a valid negative verdict, 2 refused (bad input or usage).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from docopt import DocoptExit, docopt

from replayjob import __version__
from replayjob.errors import EXIT_REFUSED, ReplayjobError, UsageError

Handler = Callable[[dict[str, Any]], int]


def _int(args: dict[str, Any], key: str) -> int:
    raw = args[key]
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{key} expects an integer, got {raw!r}") from None


def cmd_init(args: dict[str, Any]) -> int:
    from replayjob.workspace import init_workspace

    for path in init_workspace(args["<dir>"], _int(args, "--seed")):
        print(f"wrote {path}")
    return 0


def cmd_train(args: dict[str, Any]) -> int:
    from pathlib import Path

    from replayjob.config import load_config
    from replayjob.rl.trainer import train

    cfg = load_config(args["<config>"], args["--set"])
    out = Path(args["--out"] or cfg.logging.dir)
    metrics = train(cfg, out)
    print(f"trained {metrics['steps_run']} step(s); loss {metrics['loss']!r}")
    print(f"final adapter sha256 {metrics['final_adapter_sha256']}")
    print(f"wrote {out}/diag.jsonl, {out}/metrics.json")
    return 0


COMMANDS: dict[str, Handler] = {
    "init": cmd_init,
    "train": cmd_train,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, dispatch, and map domain errors to exit codes. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = docopt(__doc__ or "", argv=argv, version=__version__, default_help=True)
    except DocoptExit as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_REFUSED
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_REFUSED
    for name, handler in COMMANDS.items():
        if args.get(name):
            try:
                return handler(args)
            except ReplayjobError as exc:
                print(f"replayjob {name}: {exc.diagnostics()}", file=sys.stderr)
                return exc.exit_code
    print(__doc__, file=sys.stderr)  # pragma: no cover - docopt guarantees a command
    return EXIT_REFUSED


def console_main() -> None:
    sys.exit(main())
