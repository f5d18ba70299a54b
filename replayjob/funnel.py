"""The workstation funnel (``replayjob funnel``, ``scripts/local-mid-smoke.sh``): three stages, each gating the next.

1. ``determinism``: a short multi-step source run (at least the steps the signal rules need), twice
   with the same seed in fresh processes, diffed leaf by leaf (:mod:`replayjob.check.determinism_check`);
2. ``signals``: the behavioural signals of that run graded KILL/WARN/OK (a KILL stops the funnel);
3. ``ablation``: capture -> replays of every arm of the ablation spec, run interleaved in a seeded
   paired schedule (:mod:`replayjob.deploy.schedule`, one block = every arm once) -> reduce, with the
   report and its PNG; with ``--budgets`` the bounds are decided, and ``--until-decided`` adds one
   block at a time until every bound is decided or ``--max-repeats`` blocks ran (each reduce is one
   look of the Bonferroni alpha spending, ``--max-looks`` = max repeats).

Stage 3 runs the one launch implementation the Kubernetes Jobs, the Argo workflow and the Slurm
jobs run (:mod:`replayjob.deploy.step`): it writes the selected spec with its paired schedule and
budgets to ``OUT/ablation.toml`` and runs ``replayjob step capture`` and ``replayjob step replay
--index I`` over ``OUT`` (the step layout: ``OUT/run.json``, ``OUT/source``, ``OUT/replays/ARM/BLOCK``),
index by index in the schedule's run order.  Each look is ``replayjob step reduce --blocks N`` over
the blocks run so far (with the report and the looks' alpha spending), so the funnel reduces exactly
as the cluster launchers do: everything the reducer is told comes from the spec.  Every command goes through
:func:`cli_step`, one fresh ``python -m replayjob`` process per step, exactly as a cluster job would.
``OUT/funnel.json`` (:data:`SCHEMA`, docs/funnel.md) lists every stage and its outcome and is written last, beside the
reducer's ``verdict.json``; the exit code is the first non-passing stage's (0 pass, 1 negative,
2 refused or inconclusive, 3 error).  Planted negatives show that each stage can stop the funnel:
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
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.deploy.ablation import DETERMINISM_ENV, AblationSpec, load_spec, toml_value
from replayjob.deploy.schedule import DESIGNS
from replayjob.deploy.step import select
from replayjob.errors import RefusedError, ReplayjobError, UsageError, error_for_exit_status
from replayjob.fsio import atomic_write_bytes, atomic_write_text
from replayjob.jsonio import pretty_bytes, read_json_object

SCHEMA = "replayjob.funnel/v1"
FUNNEL_FILE = "funnel.json"
STAGES = ("determinism", "signals", "ablation")
STATUS = {0: "pass", 1: "fail", 2: "refused", 3: "error"}
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
    until_decided: bool = False
    max_repeats: int | None = None
    design: str = "abba"
    warmup_updates: int = 0
    measured_updates: int = 0
    plant_nondeterminism: bool = False
    plant_kill: bool = False
    plant_undeclared: bool = False
    report: bool = True


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
        if opts.warmup_updates < 0 or opts.measured_updates < 0 or (opts.warmup_updates and not opts.measured_updates):
            raise UsageError("--warmup-updates needs --measured-updates M >= 1 (warm-up alone measures nothing)")
        self.opts, self.say = opts, progress
        self.out = Path(opts.out).resolve()
        if (self.out / FUNNEL_FILE).exists():
            raise RefusedError("this directory already holds a funnel run", where=self.out,
                               hint="choose a new --out")
        self.device = _device(opts.device)
        self.spec: AblationSpec = select(load_spec(opts.spec), opts.arms, opts.repeats, self.device)
        # --budgets, else the spec's own budget file: the reduce decides it either way
        budgets = opts.budgets if opts.budgets is not None else (Path(self.spec.budgets) if self.spec.budgets else None)
        self.budgets = budgets.resolve() if budgets is not None else None
        if opts.until_decided and (self.budgets is None or opts.max_repeats is None):
            raise UsageError("--until-decided needs budgets (--budgets FILE or the spec's budgets) and --max-repeats N")
        if opts.max_repeats is not None and opts.max_repeats < self.spec.repeats:
            raise UsageError(f"--max-repeats {opts.max_repeats} is below the {self.spec.repeats} blocks run first")
        self.claim = opts.claim or self.spec.claim
        # the funnel's own overrides: the [config] of stage 3's spec, and --set for init and stage 1
        self.config: dict[str, Any] = {}
        if opts.model is not None:
            self.config["model.path"] = str(Path(opts.model).resolve())
            self.model = f"local directory {opts.model}"
        elif self.device == "cuda":
            self.config.update({kv.split("=", 1)[0]: tomllib.loads("v = " + kv.split("=", 1)[1])["v"]
                                for kv in MID_SIZE})
            self.model = "mid-size built from config (bfloat16)"
        else:
            self.model = "built-in tiny model"
        if opts.measured_updates:  # in-process repeats (docs/replay-metrics.md)
            self.config.update({"optimizer_batch.warmup_updates": opts.warmup_updates,
                                "optimizer_batch.measured_updates": opts.measured_updates})
        self.common = [*self.spec.config_sets(), *(f"{k}={toml_value(v)}" for k, v in self.config.items())]
        if opts.resume is not None:
            self.common.append(f"resume.from={toml_value(str(Path(opts.resume).resolve()))}")
        self.ws, self.log = self.out / "workspace", self.out / "steps.log"
        self.stages = [Stage(n) for n in STAGES]
        self.run_plan: AblationSpec = self.spec  # stage 3's spec as written to OUT/ablation.toml
        self.summary: dict[str, Any] | None = None

    def sets(self, *extra: str) -> list[str]:
        return [w for kv in (*self.common, *extra) for w in ("--set", kv)]

    # -- stages ------------------------------------------------------------------------------------
    def determinism(self, st: Stage) -> None:
        from replayjob.check.determinism_check import check
        from replayjob.check.rules import load_rules

        steps = self.opts.steps or max(2, *(r.min_rows for r in load_rules(None).signals))
        plant = ["environment.nondeterministic_observation=true"] if self.opts.plant_nondeterminism else []
        rep = check(self.ws / "train.toml", runs=2, steps=steps, out=self.out / "determinism",
                    sets=[*self.common, *plant], progress=lambda line: self.say("  " + line))
        st.code = rep.exit_code
        found = "bitwise-equal diagnostics" if rep.deterministic else "DRIFT: " + rep.render().splitlines()[-1]
        st.detail = f"{steps} steps x 2 fresh processes: {found}"
        st.artifacts = {"report": str(self.out / "determinism" / "determinism_check.json")}

    def signals(self, st: Stage) -> None:
        from replayjob.check.rules import DEFAULT_RULES, load_rules
        from replayjob.check.signals import evaluate

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
                               if f.name not in ("arms", "config")}
        top.update(claim=self.claim, device=self.device, seed=self.opts.seed, schedule=self.opts.design,
                   budgets=str(self.budgets) if self.budgets is not None else "")
        if self.opts.resume is not None:
            top["resume"] = str(Path(self.opts.resume).resolve())
        if self.opts.until_decided:
            assert self.opts.max_repeats is not None
            top.update(repeats=self.opts.max_repeats, min_repeats=sp.effective_min_repeats)
        lines = [f"{k} = {toml_value(v)}" for k, v in top.items()]
        lines += ["", "[config]", *(f'"{k}" = {toml_value(v)}' for k, v in {**sp.config, **self.config}.items())]
        for arm in sp.arms:
            lines += ["", f"[arms.{arm.name}]", *(f'"{k}" = {toml_value(v)}' for k, v in arm.overrides.items())]
        path = self.out / "ablation.toml"
        atomic_write_text(path, "\n".join(lines) + "\n")
        self.run_plan = load_spec(path)  # refused here, naming the key, rather than in every step
        return path

    def ablation(self, st: Stage) -> None:
        src, replays = self.out / "source", self.out / "replays"
        st.artifacts = {"source": str(src), "replays": str(replays), "verdict": str(self.out / "verdict.json")}
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
        while True:
            for index in range(done, blocks * len(arms)):  # the schedule's run order, block by block
                run = self.run_plan.run_for_index(index)
                assert run.slot is not None
                self.say(f"  replay block {run.slot.block} position {run.slot.position}: arm {run.arm}")
                code = cli_step(["step", "replay", *step, "--index", index, *plant], self.log)
                if code:
                    st.code = code
                    st.detail = (f"replay of arm {run.arm} (block {run.slot.block}, index {index}) exited {code} "
                                 f"(see {self.log})")
                    return
            done = blocks * len(arms)
            doc = self.reduce(spec, blocks)
            looks.append({"blocks": blocks, "status": doc["status"]})
            st.code, st.status = int(doc["exit_code"]), str(doc["status"])
            st.detail = doc["summary"]
            if not (self.opts.until_decided and doc["status"] == "inconclusive"):
                break
            assert self.opts.max_repeats is not None
            if blocks >= self.opts.max_repeats:
                st.detail += f" (still inconclusive after --max-repeats {self.opts.max_repeats} blocks)"
                break
            blocks += 1
        st.artifacts["looks"] = ", ".join(f"{x['blocks']} blocks: {x['status']}" for x in looks)
        self.summary = summarize(self.out / "verdict.json", src)

    def reduce(self, spec: Path, blocks: int) -> dict[str, Any]:
        """One look: ``replayjob step reduce --blocks N`` over the blocks run so far, the reduce every
        launcher runs (the spec's claim, arms, minimum repeats, ``mixed_hardware`` and budgets), with
        the report and the looks' alpha spending (``--max-looks``)."""
        args: list[Any] = ["step", "reduce", "--spec", spec, "--run-dir", self.out, "--blocks", blocks]
        if self.opts.report:
            args += ["--report", self.out / "report.md"]
        if self.budgets is not None:
            args += ["--max-looks", self.opts.max_repeats or 1]
        verdict = self.out / "verdict.json"
        verdict.unlink(missing_ok=True)  # a look never reads the previous look's verdict
        code = cli_step(args, self.log)
        if not verdict.is_file():
            raise error_for_exit_status(code)(f"reduce exited {code} without a verdict", where=self.log)
        return read_json_object(verdict)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> int:
        import os

        t_start = time.perf_counter()
        if self.device == "cpu":  # see the module docstring: one intra-op thread per process
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.out.mkdir(parents=True, exist_ok=True)
        self.say(f"funnel: device {self.device}; model: {self.model}; output {self.out}")
        code = cli_step(["init", self.ws, "--seed", self.opts.seed, *self.sets()], self.log)
        if code:
            raise error_for_exit_status(code)(f"replayjob init exited {code}", where=self.log, hint="see the log")
        first = 2 if self.opts.only_ablation else 0
        result = 0
        for i, st in enumerate(self.stages):
            if i < first:
                st.detail = "not run (--only-ablation)"
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
        doc = {"schema": SCHEMA, "status": STATUS[result] if result != 2 else next(
                   s.status for s in self.stages if s.code), "exit_code": result,
               "device": self.device, "model": self.model, "claim": self.claim, "spec": str(self.opts.spec),
               "arms": [a.name for a in self.spec.arms], "design": self.opts.design, "seed": self.opts.seed,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "stages": [s.to_json() for s in self.stages], "summary": self.summary,
               "wall_s": round(time.perf_counter() - t_start, 3)}
        atomic_write_bytes(self.out / FUNNEL_FILE, pretty_bytes(doc))
        self.say(render(doc))
        return result


def summarize(verdict_path: Path, source_dir: Path) -> dict[str, Any]:
    """Per arm: median step time, its ratio to the baseline with the 95% interval, the peak-memory
    ratio, and whether loss and final adapter are bitwise equal to the source; then the budgets."""
    from replayjob.gate.evidence import discover, read_replay, read_source

    doc = read_json_object(verdict_path)
    source = read_source(source_dir)
    replays = [read_replay(p) for p in discover([str(p["path"]) if Path(p["path"]).is_absolute()
                                                 else str(verdict_path.parent / p["path"])
                                                 for p in doc["inputs"]["replays"]])]
    ratios = doc["comparisons"]["ratios"]
    arms: dict[str, Any] = {}
    for name, info in doc["arms"].items():
        mine = [r for r in replays if r.arm == name]
        t = ratios.get(name, {}).get("local_train_wall_s")
        m = ratios.get(name, {}).get("peak_memory_bytes")
        arms[name] = {
            "median_step_wall_s": info["stats"]["local_train_wall_s"]["median"],
            "step_ratio": None if t is None else [t["ratio"], t["low"], t["high"]],
            "peak_memory_ratio": None if m is None else m["ratio"],
            "memory_kind": sorted({r.memory_kind for r in mine}),
            "loss_equal_source": bool(mine) and all(r.loss == source.loss for r in mine),
            "adapter_equal_source": bool(mine) and all(r.final_adapter == source.final_adapter for r in mine),
        }
    budgets = doc.get("budgets") or {}
    return {"verdict": doc["status"], "baseline": doc["comparisons"]["baseline"],
            "admission": doc["admission"], "arms": arms, "budgets": budgets.get("bounds", [])}


def _f(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def render(doc: dict[str, Any]) -> str:
    """The at-a-glance summary printed at the end of a funnel run."""
    lines = ["", f"funnel: {doc['status']} (exit {doc['exit_code']}); device {doc['device']}; {doc['model']}"]
    lines += [f"  {i}. {s['name']:<12} {s['status']:<12} {s['detail']}" for i, s in enumerate(doc["stages"], 1)]
    s = doc["summary"]
    if s:
        lines += ["", f"  {'arm':<14} {'median step s':>13}  {'ratio [95% interval]':<24} {'peak mem ratio':<22}"
                  f" loss==source  adapter==source"]
        for arm, a in s["arms"].items():
            ratio = ("1 (baseline)" if arm == s["baseline"] else "-" if a["step_ratio"] is None else
                     f"{_f(a['step_ratio'][0])} [{_f(a['step_ratio'][1])}, {_f(a['step_ratio'][2])}]")
            mem = "1 (baseline)" if arm == s["baseline"] else _f(a["peak_memory_ratio"])
            mem += f" ({','.join(a['memory_kind'])})"
            loss, adapter = ("yes" if a[k] else "NO" for k in ("loss_equal_source", "adapter_equal_source"))
            lines.append(f"  {arm:<14} {_f(a['median_step_wall_s'], '.4f'):>13}  {ratio:<24} {mem:<22}"
                         f" {loss:<13} {adapter}")
        lines.append(f"  timing {s['admission']} by the exact-input gate")
        for b in s["budgets"]:
            interval = "" if b.get("low") is None else f" {_f(b['ratio'])} [{_f(b['low'])}, {_f(b['high'])}]"
            lines.append(f"  budget {b['arm']} {b['metric']} {b['kind']} {b['limit']:g}: {b['decision']}{interval}"
                         + (f" ({b['note']})" if b.get("note") else ""))
    lines.append(f"  wall time {doc['wall_s']:.0f} s; funnel document {FUNNEL_FILE}")
    return "\n".join(lines)


def run_funnel(opts: Options, progress: Callable[[str], None] = print) -> int:
    """Run the funnel; returns its exit code (the first non-passing stage's).

    Every step inherits the determinism environment the cluster jobs pin (values already set are
    kept); this process's environment is restored afterwards.
    """
    import os

    saved = dict(os.environ)
    try:
        for key, value in DETERMINISM_ENV.items():
            os.environ.setdefault(key, value)
        return Funnel(opts, progress).run()
    finally:
        os.environ.clear()
        os.environ.update(saved)
