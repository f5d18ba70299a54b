"""replayjob: trustworthy systems experiments on RL post-training of LoRA adapters.

Usage:
  replayjob init <dir> [--seed N] [--set KEY=VALUE]...
  replayjob train <config> [--out DIR] [--set KEY=VALUE]...
  replayjob capture <config> [--out DIR] [--set KEY=VALUE]...
  replayjob explain <config> [--json] [--nproc N] [--set KEY=VALUE]...
  replayjob replay <config> [--out DIR] [--repeat N | --repeat-index I] [--slot SLOT] [--trace] [--nproc N]
                   [--set KEY=VALUE]...
  replayjob reduce <path>... --claim CLAIM --out FILE [--source DIR [--source-step K]] [--tolerances FILE]
                   [--min-repeats N] [--baseline ARM] [--arms LIST] [--spec SPEC] [--report FILE]
                   [--mixed-hardware] [--budgets FILE] [--max-looks N]
  replayjob funnel [--out DIR] [--spec SPEC] [--arms LIST] [--repeats N] [--claim CLAIM] [--seed N]
                   [--resume DIR] [--model DIR] [--device D] [--steps N] [--only-ablation]
                   [--budgets FILE] [--until-decided | --fixed-blocks] [--max-repeats N] [--design D] [--no-report]
                   [--warmup-updates W --measured-updates M] [--capture DIR [--replay-config NAME]]
                   [--plant-nondeterminism | --plant-kill | --plant-undeclared]
  replayjob step plan --spec SPEC [--plant PLANT]... [--arms LIST] [--repeats N] [--device D] [--claim CLAIM]
  replayjob step prune --run-root DIR --older-than DAYS [--dry-run]
  replayjob step capture --spec SPEC --run-dir DIR [--workspace DIR] [--source DIR] [--outputs DIR]
                   [--ranks N] [--launcher L] [--arms LIST] [--repeats N] [--device D] [--claim CLAIM]
  replayjob step replay --spec SPEC --run-dir DIR (--index I [--ranks N] | --position K --ranks N)
                   [--launcher L] [--workspace DIR] [--source DIR] [--pins PINS] [--plant PLANT]...
                   [--wait-s S] [--arms LIST] [--repeats N] [--device D] [--claim CLAIM]
  replayjob step reduce --spec SPEC --run-dir DIR [--workspace DIR] [--source DIR] [--wait-s S] [--outputs DIR]
                   [--blocks N] [--report FILE] [--max-looks N] [--ended STATUS --failures JSON]
                   [--arms LIST] [--repeats N] [--device D] [--claim CLAIM]
  replayjob step verdict --run-dir DIR --code N
  replayjob k8s render <spec> [--out DIR] [--setup DIR] [--argo FILE] [--argo-setup FILE]
  replayjob k8s submit <spec> [--namespace NS] [--wait]
  replayjob k8s resume <run-id> [--namespace NS] [--wait]
  replayjob k8s drive --spec SPEC
  replayjob argo wait <workflow> [--namespace NS]
  replayjob trace-diff <a> <b> [--reference DIR]... [--json]
  replayjob mismatch <capture> [--bound FILE] [--allow-lag] [--json] [--set KEY=VALUE]...
  replayjob diag-diff <a.jsonl> <b.jsonl> [--rtol R] [--atol A] [--ignore GLOB]... [--top N] [--json]
  replayjob determinism-check <config> [--runs K] [--steps N] [--out DIR] [--set KEY=VALUE]...
                   [--rtol R] [--atol A] [--ignore GLOB]... [--top N] [--json]
  replayjob determinism-check --command TEMPLATE [--runs K] [--out DIR]
                   [--rtol R] [--atol A] [--ignore GLOB]... [--top N] [--json]
  replayjob signals <run> [--rules FILE] [--json | --quiet]
  replayjob bundle inspect <bundle> [--json]
  replayjob bundle validate <bundle> [--json]
  replayjob bundle replay <bundle> [--stage STAGE] [--sample ID]... [--group ID]... [--batch ID]...
                   [--step R:S | --rollout R] [--examples N] [--json]
  replayjob (-h | --help)
  replayjob --version

Commands:
  init       Write an initial resume state and example configs into <dir>.
  train      Run the source trainer (training.trainer = "grpo").
  capture    Run one source step and capture its optimizer batch (prints the pins a replay needs).
  explain    Verify a replay config's pins, payload, adapter and contract without a model.
  replay     Replay the captured optimizer batch: one update, no dataset/environment/sampling.

  funnel     The workstation funnel (docs/funnel.md): (1) a short source run twice, diffed;
             (2) its behavioural signals; (3) capture -> interleaved replays of the spec's arms ->
             reduce, report and PNG.  OUT/funnel.json lists each stage; exit = first non-passing.
  reduce     Reduce replay metrics to a verdict (exact-input | bitwise | approximate); --out is the
             verdict file, --report a markdown report (plus a PNG with the 'plot' extra).
  step       One stage of an ablation under one run directory, the command every launcher runs
             (Jobs, Argo, Slurm, scripts): `capture` (init + capture, reused when complete),
             `replay --index I` (index -> arm, repeat; strict pins), `reduce` (every arm of the
             spec; always writes RUN/verdict.json), `plan` (size, parallelism, arms: KEY=VALUE),
             `prune` (retention: delete runs in which nothing was written for --older-than days),
             `verdict` (a launcher's outcome: RUN/verdict.json read strictly and confirmed by the
             reducer's exit code --code, as argo wait and the driver confirm it; 3 when they disagree).
  k8s        `render` an ablation spec as Kubernetes manifests (a run's in --out DIR, the once-applied
             setup in --setup DIR, the Argo workflow in --argo FILE), `submit` one run (its
             in-cluster driver Job chains the stages; --wait: the reducer's code), `resume` a run
             whose driver ended early, or `drive` (the driver Job's own command).
  argo       `wait` for an Argo workflow to end and exit with its reduce step's code (0 pass, 1 fail,
             2 refused, 3 error or no verdict), which `argo submit --wait` (0 or 1) does not tell.
  trace-diff Compare two traced replays (replay --trace) of one capture, or two arm directories of
             them: the first divergent module in forward and in backward order, per-layer errors,
             each divergence classified bitwise equal / within the noise envelope / beyond it
             (docs/trace-format.md); exit 0 identical, 1 divergent, 2 refused.
  mismatch   Recompute the trainer's per-token logprobs of a capture's completions from the pinned
             model state of that step (no sampling, no update), compare them with every logprob
             source the capture records (the sampler's own, the trainer's old ones), attribute the
             gap (temperature, truncation, precision, padding) and state the policy lag
             (docs/mismatch.md); <capture> is its replay config or a capture directory holding one.
             Exit 0 within the declared --bound, 1 beyond it, 2 refused or no bound declared.
  diag-diff  Compare two JSONL diagnostics leaf by leaf (rows aligned by step, else position);
             exit 1 on drift with the first divergent row and its largest drifts.
  determinism-check
             Run the source trainer (or --command with {out}) K times in fresh processes with the
             same seed and diag-diff each run against the first; runs go under --out (default: a
             new temporary directory), with OUT/determinism_check.json written last.
  signals    Grade a run directory's (or a diag.jsonl's) behavioural signals: KILL / WARN / OK
             from a rules TOML (default: the source trainer's rules, docs/signals.md).
  bundle     Trajectory bundles (docs/bundle-format.md): `inspect` identity, capabilities and
             payloads (also of incomplete bundles); `validate` format, integrity, safety and
             dependency closure (exit 0 or 2); `replay` recompute reward -> advantage -> loss with
             the trainer's stage functions and report the first divergence (exit 1).

Options:
  --seed N          Seed for the initial adapter and the example configs [default: 123].
  --out DIR         Output directory (default: logging.dir from the config).
  --set KEY=VALUE   Override a config key; VALUE is read as TOML (7, true, "x", [1, 2]).
  --json            Print the result as JSON.
  --repeat N        Run N replays, each in a fresh process, in DIR/repeat-000 ...
  --repeat-index I  Internal: this replay's index within its arm (set by --repeat and launchers).
  --slot SLOT       Internal: DESIGN:SEED:BLOCK:POSITION of this replay in a paired schedule (set
                    by launchers; recorded next to the host record so reduce pairs replays by block).
  --trace           replay: also record a layer-level trace into DIR/trace (optimizer_batch.trace).
  --nproc N         replay: run each replay on N ranks of this node (torchrun; distributed.strategy
                    "ddp"); the ranks' exit codes are merged (a refusal on any rank is 2). explain:
                    check a replay on N ranks by the same rules, before any process starts.
  --claim CLAIM     Claim to gate: exact-input, bitwise or approximate.
  --source DIR      The capture run's output directory (its metrics.json and manifest); required by
                    reduce. step: a finished capture to use instead of RUN/source (a spec's
                    [capture] names an existing capture of any producer instead).
  --tolerances FILE Predeclared tolerance TOML, pinned by SHA-256 in the replay configs.
  --min-repeats N   Fewest fresh replays per arm; fewer is refused (default 3).
  --baseline ARM    Arm the others' timing and memory are compared with.
  --report FILE     reduce, step reduce: also write a markdown report (and a PNG next to it).
  --budgets FILE    Budget TOML (docs/verdict-format.md): bounds on arm/baseline ratios, pinned
                    by SHA-256 in [optimizer_batch] budgets_sha256; each bound passes, fails (1) or
                    is inconclusive (2, with an estimate of the paired blocks that would decide it).
  --max-looks N     Budgets: the most reduces (looks) this experiment may take; each look decides
                    at level 0.05/N (Bonferroni alpha spending) [default: 1].
  --mixed-hardware  reduce: the replays may differ in GPU, driver, CUDA, torch or image (declared);
                    without it such a mix is refused (inputs.same_hardware).
  --arms LIST       Comma-separated arms. step: a subset of the spec's arms (kept in file order).
                    reduce: every arm the verdict must contain; an arm with no replay at all (or
                    one not named) is refused.
  --repeats N       Replays per arm instead of the spec's repeats.
  --device D        cuda or cpu instead of the spec's device.
  --spec SPEC       The ablation spec TOML (examples/ablation.toml).  reduce: the spec the replays
                    were launched from; each arm's intended knobs come from its overrides there, and
                    a replay launched without exactly them is refused (--arms, if given, selects a
                    subset of the spec's arms; otherwise every arm of the spec must be there).
                    funnel: the spec whose arms run (default examples/ablation.toml).
  --run-dir DIR     step: the run's directory (one per submission; see docs/cluster.md for its layout).
  --workspace DIR   step: an existing `replayjob init` directory instead of RUN/workspace.
  --outputs DIR     step: also write pins, plan.json and verdict.json here (Argo output parameters).
  --ended STATUS    step reduce: the run ended otherwise than by itself (Argo's exit handler: the
                    workflow's status); first write RUN/ended.json naming what ended it.
  --failures JSON   step reduce --ended: the workflow's failed nodes (Argo's workflow.failures).
  --index I         step replay: the array index (arms in file order, repeats innermost).
  --position K      step replay: the K-th replay (from 0) among those that run --ranks N ranks
                    (a launcher with one replay Job per rank count).
  --ranks N         step: the ranks the launcher provisioned (devices); refused unless the spec's
                    capture or replay runs exactly N ranks.
  --launcher L      step: how N > 1 ranks start: torchrun (in this process tree) or srun (the
                    tasks of this Slurm allocation) [default: torchrun].
  --pins PINS       step replay: LOGICAL,MANIFEST handed over by a controller; must equal the capture's.
  --plant PLANT     step replay: ARM:SETTING=VALUE, an undeclared override in one arm (a negative control).
                    step plan: only validated against the selection (exit 2 if malformed).
  --wait-s S        step: wait up to S seconds for an earlier stage's output [default: 0].
  --run-root DIR    step prune: the directory holding run directories (/artifacts/runs on the claim).
  --older-than DAYS step prune: delete the runs in which nothing was written for DAYS days.
  --code N          step verdict: the exit code the launcher saw the reducer end with (0 to 255).
  --dry-run         step prune: list what would be deleted; delete nothing.
  --blocks N        step reduce: only the first N blocks (repeats) of every arm: one look of a
                    sequential experiment (the funnel's --until-decided).
  --resume DIR      funnel: start from this step -1 resume state instead of the one init writes.
  --model DIR       funnel: a local model directory (safetensors) instead of the built-in model.
  --only-ablation   funnel: run stage 3 only (capture -> replays -> reduce).
  --capture DIR     funnel: run stage 3 only, on this existing capture (replayjob's, TRL's or a plain
                    PyTorch loop's), pinned as it recorded; the spec gets a [capture] table.
  --replay-config NAME  funnel --capture: the capture's replay config (default replay.toml; one
                    of several chosen steps: replay_step_<K:06d>.toml).
  --until-decided   funnel (the default): add one paired block at a time until every budget (without
                    budgets: every comparison with the baseline) is decided, or --max-repeats blocks ran.
  --fixed-blocks    funnel: run exactly --repeats (the spec's repeats) blocks, one look.
  --max-repeats N   funnel: the most paired blocks until decided (the looks' N; default:
                    replayjob.launch.funnel.MAX_BLOCKS, 8, or the spec's repeats when more).
  --design D        funnel: schedule of the arms within blocks, abba or random [default: abba].
  --no-report       funnel: skip report.md and its PNG.
  --warmup-updates W  funnel: in each replay, W in-process updates from the restored state, discarded
                    (default: replayjob.launch.funnel.WARMUP_UPDATES, 2).
  --measured-updates M  funnel: then M measured ones, recorded apart from the fresh-process update
                    (budget metric in_process_train_wall_s; default: MEASURED_UPDATES, 8; zero for
                    both turns them off).
  --plant-nondeterminism  funnel: plant a nondeterministic observation (stage 1 must stop, exit 1).
  --plant-kill      funnel: plant a signal rule that always KILLs (stage 2 must stop, exit 1).
  --plant-undeclared  funnel: the baseline arm changes a knob it does not declare (stage 3, exit 2).
  --argo FILE       Also write the Argo workflow (kubectl apply -f FILE) for the spec.
  --setup DIR       Also write what outlives runs, applied once per namespace (kubectl apply -k DIR):
                    the claim holding every run's data.
  --argo-setup FILE Also write Argo's once-per-namespace file: the executor's account and the claim.
  --namespace NS    Kubernetes namespace (default: the kubeconfig context's, or the pod's own).
  --wait            Also follow the run's driver and exit with its code, the reducer's (the driver
                    chains the stages in the cluster either way: replays only after the capture).
  --reference DIR   trace-diff: a replay of a pair (give it twice) declared to differ only by noise.
  --bound FILE      mismatch: the declared bound TOML (docs/mismatch.md), pinned by SHA-256 in
                    [optimizer_batch] mismatch_bound_sha256; without it the report ends in exit 2.
  --allow-lag       mismatch: attribute and decide across a policy lag (a source whose weights
                    predate the captured step, e.g. TRL's num_iterations > 1).
  --rtol R          diag-diff: numbers are equal when |a-b| <= atol + rtol*|b|; finite, >= 0 [default: 1e-5].
  --atol A          diag-diff: absolute tolerance; finite, >= 0 [default: 1e-7].
  --ignore GLOB     diag-diff: also ignore leaves matching GLOB (only * and ? are wildcards).
  --top N           diag-diff: drifting leaves shown per row, largest first [default: 10].
  --runs K          determinism-check: identical runs, each in a fresh process [default: 2].
  --steps N         determinism-check: steps per run (sets training.max_steps=N).
  --command TEMPLATE  determinism-check: a shell command to run instead of the source trainer;
                    {out} becomes each run's directory, which must receive diag.jsonl.
  --rules FILE      signals: rules TOML instead of the source trainer's default rules.
  --quiet           signals: print the one-line verdict only.
  --stage STAGE     bundle replay: recompute only this stage (or all) [default: all].
  --sample ID       bundle replay: select a sample (expands to its whole group).
  --group ID        bundle replay: select a semantic group.
  --batch ID        bundle replay: select a micro-batch (mb-0000, ...; expands to whole groups).
  --source-step K   reduce: compare with captured step K of the --source run (a step of
                    optimizer_batch.capture_steps, a ring-written step, or one of an external
                    trainer's steps=[...]); its final adapter is pinned by SHA-256 only, so the
                    approximate claim, which reads the source's adapter file, is refused.
  --step R:S        bundle replay: the step or update bundle of exactly this actor step
                    (rollout:step).
  --rollout R       bundle replay: the rollout or update bundle of this rollout id.
  --examples N      bundle replay: mismatching values shown per field [default: 5].
  -h --help         Show this help.
  --version         Show the version.

Exit codes: 0 pass, 1 a valid negative verdict, 2 refused (bad input or usage) or a budget
inconclusive (verdict status "inconclusive": add paired blocks and reduce again), 3 error (nothing
was decided: a bug, out of memory, a device or filesystem failure; retrying may help; the traceback
goes to replayjob-error-*.txt in the command's output directory, or to stderr; or the verdict status
"contended": a time budget rests on replays something contended with, replay those blocks).  1 and 2
are final.

Leaves diag-diff and determinism-check ignore by default (wall-clock times, rates, memory peaks;
a pattern matches the full leaf path or its last key, keys written bare even where a path quotes
them): elapsed_s, *_elapsed_s, wall_s, *_wall_s, *wall_time*, sps, *_sps, *per_sec*, *per_second*,
*timestamp*, *_time_ns, *datetime*, *peak_rss*, *max_rss*, *max_allocated*, *max_reserved*.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from docopt import DocoptExit, docopt

from replayjob import __version__
from replayjob.commands import ARGV, REEXEC
from replayjob.errors import EXIT_ERROR, EXIT_REFUSED, ReplayjobError
from replayjob.fsio import atomic_write_text
from replayjob.runtime.distributed import record_exit
from replayjob.streams import guarded

Handler = Callable[[dict[str, Any]], int]

# command -> "module:handler" in replayjob.commands, each module loaded when its command runs: a
# command imports its own module only, so `--help` and `reduce` never import what `replay` needs.  Order
# matters where docopt sets two names: `step capture|replay|reduce` also sets args["capture"] ..., and
# `bundle replay` also sets args["replay"].
COMMANDS: dict[str, str] = {
    "step": "replayjob.commands.launch:cmd_step",
    "init": "replayjob.commands.source:cmd_init",
    "train": "replayjob.commands.source:cmd_train",
    "capture": "replayjob.commands.source:cmd_capture",
    "explain": "replayjob.commands.replay:cmd_explain",
    "bundle": "replayjob.commands.bundle:cmd_bundle",
    "replay": "replayjob.commands.replay:cmd_replay",
    "reduce": "replayjob.commands.reduce:cmd_reduce",
    "funnel": "replayjob.commands.funnel:cmd_funnel",
    "diag-diff": "replayjob.commands.checks:cmd_diag_diff",
    "trace-diff": "replayjob.commands.trace:cmd_trace_diff",
    "mismatch": "replayjob.commands.mismatch:cmd_mismatch",
    "determinism-check": "replayjob.commands.checks:cmd_determinism_check",
    "signals": "replayjob.commands.checks:cmd_signals",
    "k8s": "replayjob.commands.launch:cmd_k8s",
    "argo": "replayjob.commands.launch:cmd_argo",
}


def handler(name: str) -> Handler:
    """The handler of command ``name`` (its module imported now)."""
    module, _, function = COMMANDS[name].partition(":")
    found: Handler = getattr(importlib.import_module(module), function)
    return found


_WHOLE_DOC = ("-h", "--help", "--version")


@functools.cache
def _command_usages(doc: str) -> dict[str, str]:
    """For each command word, ``doc`` with only that command's usage lines (and their continuation lines)."""
    head, sep, rest = doc.partition("Usage:\n")
    usage, blank, tail = rest.partition("\n\n")
    lines: dict[str, list[str]] = {}
    word = ""
    for line in usage.splitlines():
        parts = line.split()
        if parts[0] == "replayjob":
            word = parts[1]
        lines.setdefault(word, []).append(line)
    return {w: head + sep + "\n".join(ls) + blank + tail for w, ls in lines.items() if not w.startswith("-")}


def usage_for(argv: Sequence[str]) -> str:
    """The usage text that parses ``argv``: the lines of the command it names (docopt's parse grows much
    faster than linearly with the number of usage lines: the whole text costs tens of milliseconds on every
    start and every in-process call), or the whole text for help, the version or an unknown command (whose
    error then shows every command).  A command's parse yields the keys of its own usage lines only."""
    doc = __doc__ or ""
    if not argv or any(a in _WHOLE_DOC for a in argv):
        return doc
    return _command_usages(doc).get(argv[0], doc)


def _output_dir(args: dict[str, Any]) -> str | None:
    """The directory a command writes into, as given on its command line (None: it writes nowhere)."""
    if args.get("init"):
        return str(args["<dir>"])
    if args.get("--run-dir"):  # `step reduce` also sets args["reduce"]: its directory is the run's
        return str(args["--run-dir"])
    if args.get("reduce") and args.get("--out"):
        return os.path.dirname(os.path.abspath(args["--out"]))
    return str(args["--out"]) if args.get("--out") else None


def _report_error(name: str, exc: BaseException, out_dir: str | None) -> str:
    """Write ``exc``'s traceback to ``out_dir/replayjob-error-<time>-<pid>.txt`` (stderr when there is no
    output directory or it cannot be written) and return the one line the CLI prints.  The file name
    matches no artifact, so a retry into the same directory is not refused because of it."""
    text = "".join(traceback.format_exception(exc))
    cause = (str(exc).strip().splitlines() or [""])[0][:300]
    head = f"replayjob {name}: error (exit 3, nothing was decided; retrying may help): " \
           f"{type(exc).__name__}{': ' + cause if cause else ''}"
    if out_dir is not None:
        try:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"replayjob-error-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
                                         f"-{os.getpid()}.txt")
            atomic_write_text(path, f"replayjob {__version__} {name}\n{text}")
            return f"{head}; traceback in {path}"
        except Exception:  # the output directory itself is failing: the traceback goes to stderr
            pass
    print(text, file=sys.stderr, end="")
    return f"{head}; traceback above"


def main(argv: Sequence[str] | None = None, *, reexec: bool = False) -> int:
    """Parse ``argv``, dispatch, and map errors to exit codes. Returns the exit code.

    A :class:`ReplayjobError` exits with its own code (1 or 2, or 3 for an operational error) and one
    message.  Any other exception (a bug, ``MemoryError``, an ``OSError`` from a failing filesystem or
    device) exits 3: one line with the cause, the traceback in the output directory (see
    :func:`_report_error`).  Output is line-buffered and a closed stdout or stderr never changes the
    code (:mod:`replayjob.streams`).  ``reexec`` (the console script only) lets ``step`` re-execute itself to
    pin the determinism environment before the interpreter starts.
    """
    with guarded():  # line-buffered output; a closed reader never changes the code
        code = _main(argv, reexec)

    record_exit(code)  # one rank of a launch by `replayjob replay --nproc N`: its own code, for the launcher
    return code


def _main(argv: Sequence[str] | None, reexec: bool) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = docopt(usage_for(argv), argv=argv, version=__version__, default_help=True)
    except DocoptExit as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_REFUSED
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_REFUSED
    args[ARGV], args[REEXEC] = argv, reexec
    for name in COMMANDS:
        if args.get(name):
            try:
                return handler(name)(args)
            except ReplayjobError as exc:
                print(f"replayjob {name}: {exc.diagnostics()}", file=sys.stderr)
                return exc.exit_code
            except Exception as exc:
                try:
                    out_dir = _output_dir(args)
                except Exception:  # the error report itself must never turn an error into another code
                    out_dir = None
                print(_report_error(name, exc, out_dir), file=sys.stderr)
                return EXIT_ERROR
    print(__doc__, file=sys.stderr)  # pragma: no cover - docopt guarantees a command
    return EXIT_REFUSED


def console_main() -> None:
    sys.exit(main(reexec=True))
