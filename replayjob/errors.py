"""One error root for replayjob; each subclass carries the exit code the CLI returns.

Exit codes are the same for every command:

* 0 -- pass / success (never an exception);
* 1 -- a valid negative verdict: a gate failed, a divergence or drift was found, a KILL signal;
* 2 -- refused: missing, malformed, tampered or contradictory input, a contract violation, usage;
  also an *inconclusive* performance budget (:class:`Inconclusive`, verdict status
  ``inconclusive``): nothing is wrong with the input, but it cannot decide yet; whoever wants a
  decision reads the verdict's status and adds paired blocks (``funnel --until-decided``);
* 3 -- error: nothing was decided (a bug, out of memory, a device or filesystem failure, a cluster
  API that stayed unreachable); retrying may help.

1 and 2 are final for the launchers: every one (Kubernetes Jobs, Argo, Slurm, ``k8s submit
--wait``, the scripts) stops on them, and ``verdict.json``'s status tells an inconclusive 2 from a
refused one.  3 is the one retryable outcome.  Only :mod:`replayjob.cli` turns these into
a process exit status; library code raises them, and any exception that is not a
:class:`ReplayjobError` (``MemoryError``, an ``OSError`` that is not a refusal, a bug) becomes 3 there.
"""

from __future__ import annotations

from pathlib import Path

from replayjob.redact import redact_text

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_REFUSED = 2
EXIT_ERROR = 3

# Which exit statuses of a stage (a container, a Slurm task, a child process) end it for good, declared
# once for every launcher: the Jobs' podFailurePolicy, Argo's retry expression, the Slurm scripts'
# requeue, ``k8s submit``, ``determinism-check`` and replay's child processes all read these.  A
# decided outcome (1, 2) is final; every other non-zero status is retried (:func:`is_retryable`): 3,
# and a death by a signal, 137 (SIGKILL) included.  137 is the container's OOM kill, but just as often
# the kubelet's node-pressure eviction, a preemption's or a drain's kill after the grace period, or
# Slurm's time limit, and the status cannot tell them apart; nothing was decided, and the launchers'
# retry count (two more attempts, each bounded by the pod's deadline) bounds what a kill that repeats
# (a replay that does not fit its memory limit) can cost.
FINAL_EXIT_STATUSES = frozenset({EXIT_NEGATIVE, EXIT_REFUSED})


def is_retryable(status: int) -> bool:
    """Whether a stage that ended with process ``status`` is retried: any failure but a decided 1 or 2
    (negative statuses are Python's death by a signal, 128 + N a shell's)."""
    return status != EXIT_OK and status not in FINAL_EXIT_STATUSES


class ReplayjobError(Exception):
    """Root of every domain error.

    ``message`` says what is wrong; ``where`` names the file, key or field; ``hint`` says how to
    fix it.  :meth:`diagnostics` renders the three as the one message the CLI prints, through
    :func:`replayjob.redact.redact_text`, so a path or value quoted from a config never
    prints a credential.  ``str(exc)`` is the same text: an error raised into a user's own training
    script (the capture API) reads as the CLI would print it, with the path and the fix.
    """

    exit_code: int = EXIT_REFUSED

    def __init__(self, message: str, *, where: str | Path | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = str(where) if where is not None else None
        self.hint = hint

    def diagnostics(self) -> str:
        message = redact_text(self.message)  # each part alone: "key: message" is no key-value pair
        head = f"{redact_text(self.where)}: {message}" if self.where else message
        return f"{head}\n  fix: {redact_text(self.hint)}" if self.hint else head

    def __str__(self) -> str:
        return self.diagnostics()


class RefusedError(ReplayjobError):
    """Input refused (exit 2): missing, malformed, tampered or contradictory."""


class UsageError(RefusedError):
    """The command line itself is wrong."""


class ConfigError(RefusedError):
    """A config file or ``--set`` override is invalid."""


class IntegrityError(RefusedError):
    """A digest, size or structural invariant of an artifact does not hold."""


class ContractError(RefusedError):
    """Two artifacts that must agree (config, optimizer contract, adapter) do not."""


class DeterminismError(RefusedError):
    """Determinism controls cannot be established as asked."""


class ArtifactExistsError(RefusedError):
    """A write would overwrite an existing artifact."""


class CaptureError(RefusedError):
    """The step cannot be captured as asked (a precondition of the capture API does not hold)."""


class NegativeVerdict(ReplayjobError):
    """A valid negative verdict (exit 1): the input was sound and the answer is 'no'."""

    exit_code = EXIT_NEGATIVE


class Inconclusive(ReplayjobError):
    """A declared bound the evidence cannot decide yet (exit 2; verdict status ``inconclusive``).

    Not a :class:`RefusedError`: the input is sound, there is just too little of it; the message
    says how many more paired blocks would decide it.
    """


class OperationalError(ReplayjobError):
    """Nothing was decided (exit 3): a child process crashed, a cluster stage failed for reasons that
    are not a verdict or a refusal, an API stayed unreachable.  Retrying may help."""

    exit_code = EXIT_ERROR


def error_for_exit_status(status: int) -> type[ReplayjobError]:
    """The error class that carries a child process's (or a container's) exit ``status`` on.

    1 and 2 keep their meaning; 3, any other status and death by a signal (negative, or 128 + N from
    a shell) are errors: nothing was decided, so the caller's exit is retryable too.
    """
    if status not in FINAL_EXIT_STATUSES:
        return OperationalError
    return NegativeVerdict if status == EXIT_NEGATIVE else RefusedError
