"""The workstation funnel (``replayjob funnel``, ``scripts/local-mid-smoke.sh``): three stages, each gating the next.

1. ``determinism``: a short multi-step source run (at least the steps the signal rules need), twice
   with the same seed in fresh processes, diffed leaf by leaf (:mod:`replayjob.check.determinism_check`);
2. ``signals``: the behavioural signals of that run graded KILL/WARN/OK (a KILL stops the funnel);
3. ``ablation``: capture -> replays of every arm of the ablation spec, run interleaved in a seeded
   paired schedule (:mod:`replayjob.artifacts.schedule`, one block = every arm once) -> reduce, with the
   report and its PNG; with ``--budgets`` the bounds are decided.  By default one block at a time is
   added until every bound (without budgets: every paired comparison with the baseline, at the look's
   level) is decided or ``--max-repeats`` blocks (:data:`MAX_BLOCKS`) ran, each reduce one look of the
   Bonferroni alpha spending (``--max-looks`` = max repeats); ``--fixed-blocks`` takes one look.  A
   block whose replays a contention probe flagged is replayed once more (:meth:`Funnel.set_aside`);
   contended again, the stage is ``contended`` (exit 3).  Every replay also runs
   :data:`WARMUP_UPDATES` + :data:`MEASURED_UPDATES` in-process updates, the ones the ratios read.

Stage 3 runs the one launch implementation the Kubernetes Jobs, the Argo workflow and the Slurm
jobs run (:mod:`replayjob.launch.step`): it writes the selected spec with its paired schedule and
budgets to ``OUT/ablation.toml`` and runs ``replayjob step capture`` and ``replayjob step replay
--index I`` over ``OUT`` (the step layout: ``OUT/run.json``, ``OUT/source``, ``OUT/replays/ARM/BLOCK``),
index by index in the schedule's run order.  Each look is ``replayjob step reduce --blocks N`` over
the blocks run so far (with the report and the looks' alpha spending), so the funnel reduces exactly
as the cluster launchers do: everything the reducer is told comes from the spec.  Every command goes through
:func:`cli_step`, one fresh ``python -m replayjob`` process per step, exactly as a cluster job would.
``OUT/funnel.json`` (:data:`SCHEMA`, docs/funnel.md, declared in :mod:`replayjob.artifacts.funnel_record`) lists
every stage and its outcome and is written last, beside the reducer's ``verdict.json``; the exit code is the
first non-passing stage's (0 pass, 1 negative, 2 refused or inconclusive, 3 error).  Planted negatives show
that each stage can stop the funnel:
``--plant-nondeterminism`` (stage 1, exit 1), ``--plant-kill`` (stage 2, exit 1),
``--plant-undeclared`` (the baseline arm changes a knob it does not declare: stage 3, exit 2).

Model size follows the device: on CPU the built-in tiny model; on a GPU a mid-size model built
from config (:data:`MID_SIZE`, about 280M parameters, bfloat16); ``--model DIR`` uses a local
model directory (``replayjob init --set model.path=...`` makes its step -1 state).

On the CPU every step runs with one intra-op thread (``OMP_NUM_THREADS=1`` unless already set): on a
shared machine, two spinning OpenMP threads per process make each update 10-20 times slower and its
time mostly noise (measured: a tiny-model update 0.24 s with one thread, 4-5 s with two under load
10 on 2 cores), which would bury the difference between arms.  Source and replays run alike, so the
comparison and the bitwise checks stay like for like.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.artifacts import funnel_record
from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.artifacts.cluster_status import judge
from replayjob.artifacts.funnel_record import FUNNEL_FILE, SCHEMA, STAGES, STATUS
from replayjob.artifacts.schedule import DESIGNS
from replayjob.artifacts.spec import AblationSpec, load_spec, spec_from_dict
from replayjob.artifacts.verdict import read_verdict
from replayjob.check.determinism_check import check
from replayjob.check.rules import DEFAULT_RULES, load_rules
from replayjob.check.signals import evaluate
from replayjob.config.dump import set_args, toml_key, toml_value
from replayjob.config.load import parse_overrides, read_toml
from replayjob.errors import OperationalError, RefusedError, ReplayjobError, UsageError, error_for_exit_status
from replayjob.fsio import atomic_write_bytes, atomic_write_text
from replayjob.gate.evidence import discover, read_replay, read_source
from replayjob.jsonio import pretty_bytes
from replayjob.launch import capture_ref as external
from replayjob.launch.capture_ref import capture_pins
from replayjob.launch.step import Layout, select
from replayjob.launch.workspace import TRAIN_CONFIG

# The GPU default: a Llama-shaped model built from config, bf16 (hundreds of millions of parameters).
MID_SIZE = ("model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=24",
            "model.num_heads=16", "model.num_kv_heads=8", "model.max_position_embeddings=512",
            'model.dtype="bfloat16"')
PLANTED_KILL = """
[[signal]]
name = "planted_kill"
leaf = "grad_norm"
reducer = "max"
kill_above = -1.0
meaning = "planted by --plant-kill: a gradient norm is never negative, so this always fires"
"""
# Undeclared: systems knobs, but only a declared difference is admitted; the first one the baseline
# arm does not declare is planted.
PLANTED_UNDECLARED = ("training.micro_batch_size=2", "backend.options.gradient_checkpointing=true")
# Timing defaults (docs/funnel.md, "Decisions"): every replay also runs WARMUP_UPDATES discarded and
# MEASURED_UPDATES measured in-process updates (benchmarks/inprocess_spread.py: their relative IQR on a
# quiet host), and blocks are added until every reported comparison is decided, at most MAX_BLOCKS.
WARMUP_UPDATES = 2
MEASURED_UPDATES = 8
MAX_BLOCKS = 8


@dataclass(frozen=True)
class Options:
    """What ``replayjob funnel`` was asked (docs/funnel.md describes each)."""

    out: Path
    spec: Path = Path("examples/ablation.toml")
    arms: str | None = None
    repeats: int | None = None
    claim: str | None = None
    seed: int = 123
    resume: Path | None = None
    model: Path | None = None
    device: str | None = None
    steps: int | None = None
    only_ablation: bool = False
    budgets: Path | None = None
    until_decided: bool = True  # add blocks until decided (False: exactly the spec's or --repeats blocks)
    max_repeats: int | None = None  # the most blocks until decided (default: MAX_BLOCKS or the spec's repeats)
    design: str = "abba"
    warmup_updates: int | None = None  # None: WARMUP_UPDATES
    measured_updates: int | None = None  # None: MEASURED_UPDATES
    plant_nondeterminism: bool = False
    plant_kill: bool = False
    plant_undeclared: bool = False
    report: bool = True
    capture: Path | None = None  # an existing capture (any producer): stage 3 only, on it
    replay_config: str | None = None  # its replay config (default replay.toml)


@dataclass
class Stage:
    name: str
    code: int = 0
    status: str = "skipped"
    detail: str = ""
    wall_s: float = 0.0
    artifacts: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "exit_code": self.code, "detail": self.detail,
                "wall_s": round(self.wall_s, 3), "artifacts": self.artifacts}


def cli_step(args: Sequence[object], log: Path) -> int:
    """Run one ``replayjob`` command in a fresh process, its output appended to ``log``; its exit code.

    The one place the funnel launches a step, so a launcher change (``replayjob step ...``) is made here.
    A status outside 0-3 (a crash) is reported as 3.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as fh:
        fh.write("$ replayjob " + " ".join(str(a) for a in args) + "\n")
        fh.flush()
        code = subprocess.run([sys.executable, "-m", "replayjob", *map(str, args)], stdout=fh,
                              stderr=subprocess.STDOUT, check=False).returncode
    return code if code in STATUS else 3


def _device(requested: str | None) -> str:
    if requested is not None:
        if requested not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda, got {requested!r}")
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Funnel:
    """One funnel run: its options, the resolved spec, the common overrides and the stages."""

    def __init__(self, opts: Options, progress: Callable[[str], None]):
        if opts.design not in DESIGNS:
            raise UsageError(f"--design must be one of {', '.join(DESIGNS)}, got {opts.design!r}")
        if sum((opts.plant_nondeterminism, opts.plant_kill, opts.plant_undeclared)) > 1:
            raise UsageError("plant one negative at a time")
        self.opts, self.say = opts, progress
        self.out = Path(opts.out).resolve()
        if (self.out / FUNNEL_FILE).exists():
            raise RefusedError("this directory already holds a funnel run", where=self.out,
                               hint="choose a new --out")
        self.device = _device(opts.device)
        self.spec: AblationSpec = select(self._load_spec(), opts.arms, opts.repeats, self.device)
        if self.spec.capture is not None:
            self._existing_capture()
        # --budgets, else the spec's own budget file: the reduce decides it either way
        budgets = opts.budgets if opts.budgets is not None else (Path(self.spec.budgets) if self.spec.budgets else None)
        self.budgets = budgets.resolve() if budgets is not None else None
        if opts.max_repeats is not None and not opts.until_decided:
            raise UsageError("--max-repeats caps the blocks added until decided; --fixed-blocks runs exactly "
                             "--repeats blocks", hint="drop one of them")
        if opts.max_repeats is not None and opts.max_repeats < self.spec.repeats:
            raise UsageError(f"--max-repeats {opts.max_repeats} is below the {self.spec.repeats} blocks run first")
        # the most blocks this run may reach: every reduce is one look of the alpha spending over this many
        self.max_blocks = ((opts.max_repeats or max(MAX_BLOCKS, self.spec.repeats)) if opts.until_decided
                           else self.spec.repeats)
        self.claim = opts.claim or self.spec.claim
        # the funnel's own overrides: the [config] of stage 3's spec, and --set for init and stage 1
        self.config: dict[str, Any] = {}
        if opts.model is not None:
            self.config["model.path"] = str(Path(opts.model).resolve())
            self.model = f"local directory {opts.model}"
        elif self.spec.capture is not None:
            self.model = f"the base model of the capture {self.spec.capture.dir}"
        elif self.device == "cuda":
            self.config.update(parse_overrides(MID_SIZE))
            self.model = "mid-size built from config (bfloat16)"
        else:
            self.model = "built-in tiny model"
        # in-process repeats (docs/replay-metrics.md): every producer's replay runs them (the replay driver)
        warmup = opts.warmup_updates if opts.warmup_updates is not None else WARMUP_UPDATES
        measured = opts.measured_updates if opts.measured_updates is not None else MEASURED_UPDATES
        if warmup < 0 or measured < 0 or (warmup and not measured):
            raise UsageError("--warmup-updates needs --measured-updates M >= 1 (warm-up alone measures nothing)")
        if measured:
            self.config.update({"optimizer_batch.warmup_updates": warmup,
                                "optimizer_batch.measured_updates": measured})
        self.common = [*self.spec.config_sets(), *set_args(self.config)]
        if opts.resume is not None:
            self.common += set_args({"resume.from": str(Path(opts.resume).resolve())})
        self.layout = Layout.of(self.out)  # the run directory every `replayjob step` of the funnel writes
        self.ws, self.log = self.layout.workspace, self.out / "steps.log"
        self.stages = [Stage(n) for n in STAGES]
        self.run_plan: AblationSpec = self.spec  # stage 3's spec as written to OUT/ablation.toml
        self.summary: dict[str, Any] | None = None

    def sets(self, *extra: str) -> list[str]:
        return [w for kv in (*self.common, *extra) for w in ("--set", kv)]

    def _load_spec(self) -> AblationSpec:
        """``--spec``; with ``--capture DIR [--replay-config NAME]`` its ``[capture]`` table names that
        capture, pinned by what the capture recorded (verified again by ``step capture``)."""

        opts = self.opts
        if opts.capture is None:
            if opts.replay_config is not None:
                raise UsageError("--replay-config names a replay config of --capture DIR", hint="add --capture DIR")
            return load_spec(opts.spec)
        d = Path(opts.capture).resolve()
        name = opts.replay_config or REPLAY_CONFIG
        logical, manifest, path, _ = external.capture_pins(d, name)
        mode = external.read_manifest(path, manifest)[1]  # the math mode the capture ran in, which every step pins
        data = read_toml(opts.spec, what="ablation spec")
        data["capture"] = {"dir": str(d), "replay_config": name, "logical_sha256": logical,
                           "manifest_sha256": manifest, **({"math_mode": mode} if mode is not None else {})}
        return spec_from_dict(data, str(opts.spec))

    def _existing_capture(self) -> None:
        """``--capture DIR``, or a spec whose ``[capture]`` names an existing capture: only stage 3 runs
        (stages 1 and 2 are about the built-in source run), on that capture, the spec's arms checked
        against its producer's knobs and its pins against the capture, before anything runs."""

        opts = self.opts
        given = [name for name, on in (("--model", opts.model), ("--resume", opts.resume), ("--steps", opts.steps),
                                        ("--plant-nondeterminism", opts.plant_nondeterminism),
                                        ("--plant-kill", opts.plant_kill),
                                        ("--plant-undeclared", opts.plant_undeclared)) if on]
        if given:
            raise UsageError(f"{', '.join(given)} configure the built-in source run, which an existing capture "
                             "replaces (only the ablation stage runs)", hint="drop " + ", ".join(given))
        external.check(self.spec)

    def _source_step(self) -> int | None:
        """The chosen step an existing capture's replay config replays (``None``: a one-step capture)."""
        if self.spec.capture is None:
            return None

        return capture_pins(Path(self.spec.capture.dir), self.spec.capture.replay_config)[3]

    # -- stages ------------------------------------------------------------------------------------
    def determinism(self, st: Stage) -> None:
        steps = self.opts.steps or max(2, *(r.min_rows for r in load_rules(None).signals))
        plant = ["environment.nondeterministic_observation=true"] if self.opts.plant_nondeterminism else []
        rep = check(self.ws / TRAIN_CONFIG, runs=2, steps=steps, out=self.out / "determinism",
                    sets=[*self.common, *plant], progress=lambda line: self.say("  " + line))
        st.code = rep.exit_code
        found = "bitwise-equal diagnostics" if rep.deterministic else "DRIFT: " + rep.render().splitlines()[-1]
        st.detail = f"{steps} steps x 2 fresh processes: {found}"
        st.artifacts = {"report": str(self.out / "determinism" / "determinism_check.json")}

    def signals(self, st: Stage) -> None:
        rules_path = None
        if self.opts.plant_kill:
            from importlib import resources

            text = resources.files("replayjob").joinpath("data", DEFAULT_RULES).read_text(encoding="utf-8")
            rules_path = self.out / "planted_rules.toml"
            atomic_write_text(rules_path, text + PLANTED_KILL)
        rep = evaluate(self.out / "determinism" / "run_0", load_rules(rules_path))
        atomic_write_bytes(self.out / "signals.json", pretty_bytes(rep.to_json()))
        st.code = rep.exit_code
        st.detail = rep.quiet()
        st.artifacts = {"report": str(self.out / "signals.json")}

    def run_spec(self) -> Path:
        """``OUT/ablation.toml``: the selected spec as stage 3 runs it, the one file every ``replayjob
        step`` of the stage reads: the paired schedule (``--design``, seeded by ``--seed``), the budgets,
        the device, the claim and the funnel's own overrides (model, in-process repeats) in ``[config]``.
        With ``--until-decided`` it holds ``--max-repeats`` blocks, of which the looks run a prefix."""
        sp = self.spec
        top: dict[str, Any] = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)
                               if f.name not in ("arms", "config", "capture", "pods")}  # pods: no stage pod here
        top.update(claim=self.claim, device=self.device, seed=self.opts.seed, schedule=self.opts.design,
                   budgets=str(self.budgets) if self.budgets is not None else "")
        if self.opts.resume is not None:
            top["resume"] = str(Path(self.opts.resume).resolve())
        if self.opts.until_decided:
            top.update(repeats=self.max_blocks, min_repeats=sp.effective_min_repeats)
        lines = [f"{toml_key(k)} = {toml_value(v, k)}" for k, v in top.items()]
        lines += ["", "[config]", *(f"{toml_key(k)} = {toml_value(v, k)}"
                                    for k, v in {**sp.config, **self.config}.items())]
        if sp.capture is not None:
            lines += ["", "[capture]", *(f"{k} = {toml_value(v, k)}"
                                         for k, v in dataclasses.asdict(sp.capture).items())]
        for arm in sp.arms:
            lines += ["", f"[arms.{toml_key(arm.name)}]", *(f"{toml_key(k)} = {toml_value(v, k)}"
                                                             for k, v in arm.overrides.items())]
        path = self.out / "ablation.toml"
        atomic_write_text(path, "\n".join(lines) + "\n")
        self.run_plan = load_spec(path)  # refused here, naming the key, rather than in every step
        return path

    def ablation(self, st: Stage) -> None:
        src = Path(self.spec.capture.dir) if self.spec.capture is not None else self.layout.source
        st.artifacts = {"source": str(src), "replays": str(self.layout.replays), "verdict": str(self.layout.verdict)}
        spec = self.run_spec()
        st.artifacts["spec"] = str(spec)
        step = ["--spec", spec, "--run-dir", self.out]
        code = cli_step(["step", "capture", *step], self.log)
        if code:
            st.code, st.detail = code, f"capture exited {code} (see {self.log})"
            return
        arms = [a.name for a in self.spec.arms]
        plant: list[str] = []
        if self.opts.plant_undeclared:
            base = self.spec.arm(arms[0])
            kv = next(kv for kv in PLANTED_UNDECLARED if kv.split("=")[0] not in base.overrides)
            plant = ["--plant", f"{arms[0]}:{kv}"]
        blocks, looks, done = self.spec.repeats, [], 0
        redo: list[int] = []  # the indexes of contended blocks to replay once more
        retried: set[int] = set()
        while True:
            for index in [*redo, *range(done, blocks * len(arms))]:  # the schedule's run order, block by block
                run = self.run_plan.run_for_index(index)
                assert run.slot is not None
                self.say(f"  replay block {run.slot.block} position {run.slot.position}: arm {run.arm}")
                code = cli_step(["step", "replay", *step, "--index", index, *plant], self.log)
                if code:
                    st.code = code
                    st.detail = (f"replay of arm {run.arm} (block {run.slot.block}, index {index}) exited {code} "
                                 f"(see {self.log})")
                    return
            done, redo = blocks * len(arms), []
            doc = self.reduce(spec, blocks)
            looks.append({"blocks": blocks, "status": doc["status"]})
            st.code, st.status = int(doc["exit_code"]), str(doc["status"])
            st.detail = doc["summary"]
            contended = contended_blocks(doc)
            if contended and doc["status"] in ("pass", "inconclusive", "contended"):
                if set(contended) - retried:  # each contended block is replayed once more, in fresh directories
                    for block in sorted(set(contended) - retried):
                        self.say(f"  block {block}: contended ({contended[block]}); replaying it once more")
                        self.set_aside(block, arms)
                        redo += range(block * len(arms), (block + 1) * len(arms))
                    retried |= set(contended)
                    continue
                st.code, st.status = 3, "contended"
                st.detail = (f"timing not admitted: block(s) {', '.join(map(str, sorted(contended)))} contended "
                             f"again after one retry ({'; '.join(contended.values())}); {doc['summary']}")
                break
            waiting = undecided(doc)
            if not (self.opts.until_decided and waiting):
                break
            if blocks >= self.max_blocks:
                st.detail += f" (inconclusive after {blocks} blocks: {', '.join(waiting)})"
                break
            blocks += 1
        st.artifacts["looks"] = ", ".join(f"{x['blocks']} blocks: {x['status']}" for x in looks)
        self.summary = summarize(self.layout.verdict, src, self._source_step(), doc)
        self.summary["blocks"] = blocks
        self.summary["max_blocks"] = self.max_blocks

    def set_aside(self, block: int, arms: list[str]) -> None:
        """Move block ``block``'s replays to ``OUT/attempts/`` (kept, never reduced), so that ``step replay``
        runs them again rather than reusing them."""
        aside = self.out / "attempts"
        aside.mkdir(parents=True, exist_ok=True)
        for arm in arms:
            d = self.layout.replay(arm, block)
            if d.exists():
                n = sum(1 for _ in aside.glob(f"contended-{arm}-{block}.*"))
                d.rename(aside / f"contended-{arm}-{block}.{n}")

    def reduce(self, spec: Path, blocks: int) -> dict[str, Any]:
        """One look: ``replayjob step reduce --blocks N`` over the blocks run so far, the reduce every
        launcher runs (the spec's claim, arms, minimum repeats, ``mixed_hardware`` and budgets), with
        the report and the looks' alpha spending (``--max-looks``)."""
        args: list[Any] = ["step", "reduce", "--spec", spec, "--run-dir", self.out, "--blocks", blocks]
        if self.opts.report:
            args += ["--report", self.out / "report.md"]
        args += ["--max-looks", self.max_blocks if self.opts.until_decided else 1]  # this look's level
        verdict = self.layout.verdict
        verdict.unlink(missing_ok=True)  # a look never reads the previous look's verdict
        code = cli_step(args, self.log)
        if not verdict.is_file():
            raise error_for_exit_status(code)(f"reduce exited {code} without a verdict", where=self.log)
        return looked(verdict, code, self.log)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> int:
        import os

        t_start = time.perf_counter()
        if self.device == "cpu":  # see the module docstring: one intra-op thread per process
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.out.mkdir(parents=True, exist_ok=True)
        self.say(f"funnel: device {self.device}; model: {self.model}; output {self.out}")
        code = 0 if self.spec.capture else cli_step(["init", self.ws, "--seed", self.opts.seed, *self.sets()], self.log)
        if code:
            raise error_for_exit_status(code)(f"replayjob init exited {code}", where=self.log, hint="see the log")
        first = 2 if self.opts.only_ablation or self.spec.capture else 0
        result = 0
        for i, st in enumerate(self.stages):
            if i < first:
                st.detail = "not run (--only-ablation)" if self.spec.capture is None else (
                    "not run: an existing capture (stages 1-2 are about the built-in source run)")
                continue
            if result:
                st.detail = "not run: an earlier stage did not pass"
                continue
            self.say(f"== stage {i + 1}/3: {st.name}")
            t0 = time.perf_counter()
            st.status = ""  # a stage names its status only when its exit code does not (inconclusive)
            try:
                getattr(self, st.name)(st)
            except ReplayjobError as exc:
                st.code, st.status, st.detail = exc.exit_code, "", exc.diagnostics()
            st.wall_s = time.perf_counter() - t0
            st.status = st.status or STATUS[st.code]
            self.say(f"   {st.status}: {st.detail}")
            result = st.code
        doc = {"schema": SCHEMA, "status": STATUS[result] if result not in (2, 3) else next(
                   s.status for s in self.stages if s.code), "exit_code": result,
               "device": self.device, "model": self.model, "claim": self.claim, "spec": str(self.opts.spec),
               "arms": [a.name for a in self.spec.arms], "design": self.opts.design, "seed": self.opts.seed,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "stages": [s.to_json() for s in self.stages], "summary": self.summary,
               "wall_s": round(time.perf_counter() - t_start, 3)}
        funnel_record.write(self.out / FUNNEL_FILE, doc)  # read back through its declaration first
        self.say(render(doc))
        return result


def looked(verdict: Path, code: int, log: Path) -> dict[str, Any]:
    """The verdict a look's reduce wrote, read as every launcher reads one (:func:`read_verdict`) and
    cross-checked with the reducer's exit ``code`` (:func:`judge`): a verdict that cannot be read, or one
    the reducer's code contradicts, decides nothing (:class:`OperationalError`, exit 3), never a stage's
    outcome."""
    try:
        doc, unreadable = read_verdict(verdict), None
    except ReplayjobError as exc:
        doc, unreadable = None, exc.message
    _, line = judge(doc, unreadable, code, f"reduce exited {code}")
    if doc is None or code != doc.exit_code:
        raise OperationalError(line, where=verdict, hint=f"the reducer's log says why: {log}")
    return doc.doc


def summarize(verdict_path: Path, source_dir: Path, source_step: int | None = None,
              doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per arm: median step time, its ratio to the baseline with the 95% interval, the peak-memory
    ratio, and whether loss and final adapter are bitwise equal to the source; then the budgets.  ``doc``:
    the verdict as the last look read it (else read strictly from ``verdict_path``)."""

    doc = doc if doc is not None else read_verdict(verdict_path).doc
    source = read_source(source_dir, source_step)
    replays = [read_replay(p) for p in discover([str(p["path"]) if Path(p["path"]).is_absolute()
                                                 else str(verdict_path.parent / p["path"])
                                                 for p in doc["inputs"]["replays"]])]
    ratios = doc["comparisons"]["ratios"]
    # the paired comparison at this look's level where the schedule pairs the replays (the warm in-process
    # updates where every replay ran them), else the unpaired ratio of fresh-process update medians
    paired = doc["comparisons"].get("paired") or {}
    metric = paired.get("metric", "local_train_wall_s")
    warm = doc.get("in_process") or {}
    arms: dict[str, Any] = {}
    for name, info in doc["arms"].items():
        mine = [r for r in replays if r.arm == name]
        p = paired.get("arms", {}).get(name)
        t = p if p is not None else ratios.get(name, {}).get(metric)
        m = ratios.get(name, {}).get("peak_memory_bytes")
        arms[name] = {
            "median_step_wall_s": info["stats"]["local_train_wall_s"]["median"],
            "median_warm_wall_s": ((warm.get(name) or {}).get("local_train_wall_s") or {}).get("median"),
            "decision": None if p is None else p["decision"],
            "step_ratio": None if t is None else [t["ratio"], t["low"], t["high"]],
            "peak_memory_ratio": None if m is None else m["ratio"],
            "memory_kind": sorted({r.memory_kind for r in mine}),
            "loss_equal_source": bool(mine) and all(r.loss == source.loss for r in mine),
            "adapter_equal_source": bool(mine) and all(r.final_adapter == source.final_adapter for r in mine),
        }
    budgets = doc.get("budgets") or {}
    return {"verdict": doc["status"], "baseline": doc["comparisons"]["baseline"],
            "admission": doc["admission"], "timing_metric": metric,
            "confidence": paired.get("look_confidence", 0.95), "paired": bool(paired),
            "max_looks": paired.get("max_looks", 1),
            "contended": (doc.get("contention") or {}).get("contended", []),
            "arms": arms, "budgets": budgets.get("bounds", [])}


def contended_blocks(doc: dict[str, Any]) -> dict[int, str]:
    """Block -> which of its replays a contention probe flagged and why, from a verdict document."""
    out: dict[int, list[str]] = {}
    for c in (doc.get("contention") or {}).get("contended", []):
        if c.get("block") is not None:
            out.setdefault(int(c["block"]), []).append(f"{c['arm']}#{c['repeat_index']}: {', '.join(c['reasons'])}")
    return {b: "; ".join(v) for b, v in sorted(out.items())}


def undecided(doc: dict[str, Any]) -> list[str]:
    """What one more paired block could decide: the inconclusive budgets; without budgets, each paired
    comparison whose interval at this look's level still includes 1."""
    if doc["status"] == "inconclusive":
        return [f"{b['arm']} {b['metric']} {b['kind']}" for b in doc["budgets"]["bounds"]
                if b["decision"] == "inconclusive"]
    if doc["status"] != "pass" or doc.get("budgets"):
        return []
    paired = doc["comparisons"].get("paired") or {}
    return [f"{arm} {paired['metric']}" for arm, r in sorted(paired.get("arms", {}).items())
            if r["decision"] == "undecided"]


def _f(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def render(doc: dict[str, Any]) -> str:
    """The at-a-glance summary printed at the end of a funnel run."""
    lines = ["", f"funnel: {doc['status']} (exit {doc['exit_code']}); device {doc['device']}; {doc['model']}"]
    lines += [f"  {i}. {s['name']:<12} {s['status']:<12} {s['detail']}" for i, s in enumerate(doc["stages"], 1)]
    s = doc["summary"]
    if s:
        blocks = s.get("blocks")
        lines += ["", f"  {'arm':<14} {'median step s':>13} {'warm step s':>11}  {'ratio [interval]':<30} "
                      f"{'peak mem ratio':<22} loss==source  adapter==source"]
        for arm, a in s["arms"].items():
            ratio = ("1 (baseline)" if arm == s["baseline"] else "-" if a["step_ratio"] is None else
                     f"{_f(a['step_ratio'][0])} [{_f(a['step_ratio'][1])}, {_f(a['step_ratio'][2])}]")
            if a.get("decision") == "undecided":  # an interval that still includes 1 is not shown as a result
                ratio = (f"inconclusive after {blocks} block{'' if blocks == 1 else 's'}" if blocks is not None
                         else "inconclusive")
            elif a.get("decision") == "not_evaluated":
                ratio = "not admitted" + (" (contended)" if s.get("contended") else "")
            mem = "1 (baseline)" if arm == s["baseline"] else _f(a["peak_memory_ratio"])
            mem += f" ({','.join(a['memory_kind'])})"
            loss, adapter = ("yes" if a[k] else "NO" for k in ("loss_equal_source", "adapter_equal_source"))
            lines.append(f"  {arm:<14} {_f(a['median_step_wall_s'], '.4f'):>13} "
                         f"{_f(a.get('median_warm_wall_s'), '.4f'):>11}  {ratio:<30} {mem:<22} {loss:<13} {adapter}")
        level = f"{s.get('confidence', 0.95):.4g}"
        lines.append(f"  ratio: {s.get('timing_metric', 'local_train_wall_s')}, "
                     + (f"paired per block, interval at confidence {level} (one look of at most "
                        f"{s.get('max_looks', 1)})" if s.get("paired") else f"ratio of medians, {level} interval"))
        lines.append(f"  timing {s['admission']} by the exact-input gate")
        lines += [f"  contended: {c['arm']} repeat {c['repeat_index']}: {'; '.join(c['reasons'])}"
                  for c in s.get("contended", [])]
        for b in s["budgets"]:
            interval = "" if b.get("low") is None else f" {_f(b['ratio'])} [{_f(b['low'])}, {_f(b['high'])}]"
            lines.append(f"  budget {b['arm']} {b['metric']} {b['kind']} {b['limit']:g}: {b['decision']}{interval}"
                         + (f" ({b['note']})" if b.get("note") else ""))
    lines.append(f"  wall time {doc['wall_s']:.0f} s; funnel document {FUNNEL_FILE}")
    return "\n".join(lines)


def run_funnel(opts: Options, progress: Callable[[str], None] = print) -> int:
    """Run the funnel; returns its exit code (the first non-passing stage's).

    Every step inherits the determinism environment the cluster jobs pin for the spec
    (:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`: the math mode of its existing
    capture; values already set are kept, and a step refuses one that contradicts it); this process's
    environment is restored afterwards.
    """
    import os

    saved = dict(os.environ)
    try:
        funnel = Funnel(opts, progress)
        for key, value in funnel.spec.determinism_env().items():
            os.environ.setdefault(key, value)
        return funnel.run()
    finally:
        os.environ.clear()
        os.environ.update(saved)
