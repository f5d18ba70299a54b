"""`step`, `k8s` and `argo`: the one launch implementation, and the cluster paths over it."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

from replayjob.artifacts.spec import load_spec, load_spec_text
from replayjob.commands import ARGV, REEXEC
from replayjob.commands._args import integer, integer_or
from replayjob.errors import OperationalError
from replayjob.fsio import atomic_write_text
from replayjob.launch import argo, k8s, step
from replayjob.launch import capture_ref as external
from replayjob.launch import k8s_driver as driver
from replayjob.launch.submit import resume, submit
from replayjob.launch.workflow import wait_for_workflow


def cmd_step(args: dict[str, Any]) -> int:
    def terminated(signum: int, frame: object) -> None:  # preemption, eviction, scancel, requeue: retryable
        raise _Terminated(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        return _step(args)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return _step(args)
    except _Terminated as exc:
        raise OperationalError(f"terminated by signal {exc.args[0]} (preemption, eviction or cancellation)") from None
    finally:  # main() called as a library leaves the caller's handler as it found it
        signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM during a step.  A BaseException, as KeyboardInterrupt is: the signal may arrive inside a
    library's ``except Exception`` (an import probe, a retry loop), and an Exception raised there would
    be swallowed and the step would run on to completion beside the attempt Slurm or Kubernetes starts
    next, both writing the same replay."""


def _step(args: dict[str, Any]) -> int:
    if args["prune"]:  # retention: no spec, no run directory
        step.prune_runs(Path(args["--run-root"]), integer(args, "--older-than"), dry_run=args["--dry-run"])
        return 0
    if args["verdict"]:  # a launcher's outcome: no spec, the run directory's verdict and the reducer's code
        return step.confirm_verdict(Path(args["--run-dir"]), integer(args, "--code"))
    spec = step.select(load_spec(args["--spec"]), args["--arms"],
                       integer_or(args, "--repeats", None),
                       args["--device"], args["--claim"])
    if args["plan"]:
        external.check(spec)  # an existing capture: its pins, and the arms' keys among its producer's knobs
        step.parse_plants(spec, args["--plant"])
        print("\n".join(step.plan_lines(spec)))
        return 0
    step.ensure_determinism_env(args[ARGV], reexec=args[REEXEC], spec=spec)
    layout = step.layout_for(spec, args["--run-dir"], args["--workspace"], args["--source"])
    outputs = Path(args["--outputs"]) if args["--outputs"] else None
    wait_s = integer(args, "--wait-s")
    ranks = integer_or(args, "--ranks", None)
    if args["capture"]:
        step.capture_step(spec, layout, outputs, ranks=ranks, launcher=args["--launcher"])
    elif args["replay"]:
        index = step.resolve_index(spec, integer_or(args, "--index", None),
                                   integer_or(args, "--position", None), ranks)
        step.replay_step(spec, layout, index, pins=args["--pins"], plants=args["--plant"], wait_s=wait_s,
                         launcher=args["--launcher"])
    else:
        step.reduce_step(spec, layout, wait_s=wait_s, outputs=outputs,
                         blocks=integer_or(args, "--blocks", None),
                         report=Path(args["--report"]) if args["--report"] else None,
                         max_looks=integer(args, "--max-looks"),
                         ended=(args["--ended"], args["--failures"]) if args["--ended"] is not None else None,
                         ).raise_for_status()
    return 0


def cmd_k8s(args: dict[str, Any]) -> int:
    if args["drive"]:
        return driver.main(args["--spec"])
    if args["resume"]:
        return resume(args["<run-id>"], args["--namespace"], wait=args["--wait"])
    spec, text = load_spec_text(args["<spec>"])

    external.check(spec, reachable_only=True, log=lambda line: print(line, file=sys.stderr))
    if args["submit"]:
        return submit(spec, text, args["--namespace"], wait=args["--wait"])
    files, setup = k8s.render(spec, text), k8s.render_setup(spec)
    if args["--out"]:
        for path in k8s.write(files, args["--out"], source=args["<spec>"]):
            print(f"wrote {path}")
    else:
        print(k8s.dump([d for d in [*setup.values(), *files.values()] if k8s.is_manifest(d)]), end="")
    if args["--setup"]:
        for path in k8s.write(setup, args["--setup"], source=args["<spec>"], header=k8s.SETUP_HEADER):
            print(f"wrote {path}")
    if args["--argo"]:
        atomic_write_text(args["--argo"], argo.dump(spec, text, source=args["<spec>"]))
        print(f"wrote {args['--argo']}")
    if args["--argo-setup"]:
        atomic_write_text(args["--argo-setup"], argo.dump_setup(spec, source=args["<spec>"]))
        print(f"wrote {args['--argo-setup']}")
    return 0


def cmd_argo(args: dict[str, Any]) -> int:
    return wait_for_workflow(args["<workflow>"], args["--namespace"])
