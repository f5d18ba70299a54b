"""The container commands of an ablation: POSIX shell scripts driven by environment variables.

The Kubernetes Jobs and the Argo workflow run exactly these texts (``sh -c SCRIPT``); only the
environment differs.  Each script calls the ``replayjob`` CLI, so a chain of them is the same chain
as ``scripts/local-mid-smoke.sh``.  Everything lives under one run directory on the shared volume::

    $REPLAYJOB_RUN_DIR/workspace/            replayjob init (init_resume/, source.toml, replay.toml)
    $REPLAYJOB_RUN_DIR/source/               replayjob capture (metrics.json written last)
    $REPLAYJOB_RUN_DIR/replays/ARM/REPEAT/   replayjob replay (replay_metrics.json)
    $REPLAYJOB_RUN_DIR/verdict.json          replayjob reduce

How the pins reach the replays: a replay uses ``REPLAYJOB_EXPECTED_LOGICAL_SHA256`` and
``REPLAYJOB_EXPECTED_MANIFEST_SHA256`` when they are set (Argo passes the capture step's output
parameters, so the pins travel through the workflow controller, not the volume); when they are not
set (plain Kubernetes Jobs) the script reads them from ``source/metrics.json`` with a short stdlib
Python snippet that refuses anything but two 64-digit hex digests.  Either way ``replayjob replay``
then verifies the manifest and the logical rows against them before it builds a model.

Environment read by the scripts:

==================================== ==========================================================
``REPLAYJOB_RUN_DIR``                the run directory (required)
``REPLAYJOB_SEED``                   seed for ``replayjob init`` (prepare)
``REPLAYJOB_CONFIG_SETS``            ``KEY=VALUE`` words applied to the capture and every replay
``REPLAYJOB_ARM`` / ``_ARM_SETS``    arm name and its overrides (replay)
``REPLAYJOB_REPEAT``                 repeat index; defaults to ``JOB_COMPLETION_INDEX``
``REPLAYJOB_ARMS`` / ``_REPEATS``    arm names and repeats the reducer waits for (plain Jobs)
``REPLAYJOB_ARMS_JSON``              Argo: the ``arms`` parameter; prepare writes the fan-out plan
``REPLAYJOB_CLAIM`` / ``_MIN_REPEATS`` what the reducer checks
``REPLAYJOB_WAIT_S``                 how long to wait for an earlier Job's output (0: must exist)
``REPLAYJOB_OUTPUTS``                Argo: where plan.json, the pins and verdict.json are copied
==================================== ==========================================================

Retries are safe: a step whose completion file exists is skipped, and a partial output of an
interrupted attempt is removed before the step runs again.
"""

from __future__ import annotations

WAIT_FOR = """\
wait_for() {  # an input written by an earlier Job; REPLAYJOB_WAIT_S bounds the wait
  waited=0
  while [ ! -f "$1" ]; do
    if [ "$waited" -ge "${REPLAYJOB_WAIT_S:-0}" ]; then
      echo "replayjob: refused: missing input $1 (waited ${waited}s)" >&2
      exit 2
    fi
    sleep 10
    waited=$((waited + 10))
  done
}
"""

HEAD = """\
set -eu
set -f
run=${REPLAYJOB_RUN_DIR:?REPLAYJOB_RUN_DIR must name the run directory}
"""

PREPARE = HEAD + """\
ws=$run/workspace
if [ -d "$ws" ]; then
  echo "prepare: reusing $ws"
else
  mkdir -p "$run"
  rm -rf "$ws.partial"
  replayjob init "$ws.partial" --seed "${REPLAYJOB_SEED:-123}"
  mv "$ws.partial" "$ws"
fi
if [ -n "${REPLAYJOB_OUTPUTS:-}" ]; then
  mkdir -p "$REPLAYJOB_OUTPUTS"
  python3 - "${REPLAYJOB_ARMS_JSON:?}" "${REPLAYJOB_REPEATS:?}" >"$REPLAYJOB_OUTPUTS/plan.json" <<'PY'
import json, re, sys
arms, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
ok = isinstance(arms, list) and arms and repeats >= 1 and all(
    isinstance(a, dict) and set(a) == {"name", "sets"}
    and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", str(a["name"]))
    and re.fullmatch(r'[A-Za-z0-9_.=/:@+ "-]*', str(a["sets"])) for a in arms)
if not ok or len({a["name"] for a in arms}) != len(arms):
    print('arms must be a JSON list of {"name": "dns-label", "sets": "KEY=VALUE ..."}', file=sys.stderr)
    sys.exit(2)
print(json.dumps([{"arm": a["name"], "sets": a["sets"], "repeat": str(r)}
                  for a in arms for r in range(repeats)]))
PY
fi
"""

PINS_PY = """\
import json, re, sys
m = json.load(open(sys.argv[1], encoding="utf-8"))
pins = [m.get("optimizer/logical_batch_sha256"), m.get("optimizer_batch/manifest_sha256")]
if not all(isinstance(p, str) and re.fullmatch("[0-9a-f]{64}", p) for p in pins):
    print(sys.argv[1] + ": no valid pins", file=sys.stderr)
    sys.exit(2)
print(*pins)
"""

CAPTURE = HEAD + WAIT_FOR + """\
src=$run/source
wait_for "$run/workspace/source.toml"
if [ -f "$src/metrics.json" ]; then
  echo "capture: $src is complete; reusing it"
else
  rm -rf "$src"
  set --
  for kv in ${REPLAYJOB_CONFIG_SETS:-}; do set -- "$@" --set "$kv"; done
  replayjob capture "$run/workspace/source.toml" --out "$src" "$@"
fi
if [ -n "${REPLAYJOB_OUTPUTS:-}" ]; then
  mkdir -p "$REPLAYJOB_OUTPUTS"
  pins=$(python3 -c '""" + PINS_PY + """' "$src/metrics.json")
  printf '%s' "${pins% *}" >"$REPLAYJOB_OUTPUTS/logical_sha256"
  printf '%s' "${pins#* }" >"$REPLAYJOB_OUTPUTS/manifest_sha256"
fi
"""

REPLAY = HEAD + WAIT_FOR + """\
arm=${REPLAYJOB_ARM:?REPLAYJOB_ARM must name the arm}
repeat=${REPLAYJOB_REPEAT:-${JOB_COMPLETION_INDEX:?REPLAYJOB_REPEAT or JOB_COMPLETION_INDEX is required}}
src=$run/source
out=$run/replays/$arm/$repeat
wait_for "$src/metrics.json"
if [ -f "$out/replay_metrics.json" ]; then
  echo "replay: $out is complete; reusing it"
  exit 0
fi
logical=${REPLAYJOB_EXPECTED_LOGICAL_SHA256:-}
manifest=${REPLAYJOB_EXPECTED_MANIFEST_SHA256:-}
if [ -z "$logical" ] || [ -z "$manifest" ]; then
  pins=$(python3 -c '""" + PINS_PY + """' "$src/metrics.json")
  logical=${pins% *}
  manifest=${pins#* }
fi
set --
for kv in ${REPLAYJOB_CONFIG_SETS:-}; do set -- "$@" --set "$kv"; done
allow=
for kv in ${REPLAYJOB_ARM_SETS:-}; do
  set -- "$@" --set "$kv"
  allow="$allow${allow:+, }\\"${kv%%=*}\\""
done
rm -rf "$out"
mkdir -p "$run/replays/$arm"
exec replayjob replay "$run/workspace/replay.toml" --out "$out" --repeat-index "$repeat" "$@" \\
  --set "optimizer_batch.replay_path=\\"$src/optimizer_batch_step_000000.manifest.json\\"" \\
  --set "optimizer_batch.expected_logical_sha256=\\"$logical\\"" \\
  --set "optimizer_batch.expected_manifest_sha256=\\"$manifest\\"" \\
  --set "optimizer_batch.arm=\\"$arm\\"" \\
  --set "optimizer_batch.allow_config_differences=[$allow]"
"""

REDUCE = HEAD + WAIT_FOR + """\
for arm in ${REPLAYJOB_ARMS:-}; do
  i=0
  while [ "$i" -lt "${REPLAYJOB_REPEATS:?}" ]; do
    wait_for "$run/replays/$arm/$i/replay_metrics.json"
    i=$((i + 1))
  done
done
set +e
replayjob reduce "$run/replays" --claim "${REPLAYJOB_CLAIM:?}" --source "$run/source" \\
  --out "$run/verdict.json" --min-repeats "${REPLAYJOB_MIN_REPEATS:?}"
code=$?
set -e
echo "reduce: exit $code; verdict $run/verdict.json"
if [ -n "${REPLAYJOB_OUTPUTS:-}" ] && [ -f "$run/verdict.json" ]; then
  mkdir -p "$REPLAYJOB_OUTPUTS"
  cp "$run/verdict.json" "$REPLAYJOB_OUTPUTS/verdict.json"
fi
exit "$code"
"""

REPORT = HEAD + """\
echo "workflow ${REPLAYJOB_WORKFLOW:-}: ${REPLAYJOB_STATUS:-}"
if [ -f "$run/verdict.json" ]; then
  cat "$run/verdict.json"
else
  echo "no verdict at $run/verdict.json"
fi
"""

SCRIPTS: dict[str, str] = {"prepare": PREPARE, "capture": CAPTURE, "replay": REPLAY, "reduce": REDUCE,
                           "report": REPORT}


def command(step: str) -> list[str]:
    """The container command of ``step`` (prepare, capture, replay or reduce)."""
    return ["/bin/sh", "-c", SCRIPTS[step]]
