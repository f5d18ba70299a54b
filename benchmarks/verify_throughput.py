"""Verification throughput: ``explain`` and ``bundle validate`` on a large payload against raw SHA-256.

Two arms, each on about ``--mib`` MiB of payload bytes (1024 = 1 GiB; ``--smoke``: 2 MiB):

* ``explain``: a real capture of the tiny default (``replayjob init`` + ``capture``) whose payload is
  replaced by an optimizer batch of that size (rows of 16 prompt + 4,096 response tokens, built
  with the capture's own encoder, digests and manifest writer), then ``replayjob explain`` with
  both pins, in this process, exit 0 required;
* ``bundle validate``: a seeded synthetic rollout bundle (:mod:`replayjob.bundle.synthetic`, long
  responses) whose payload file is about that size, then ``replayjob bundle validate``, exit 0.

Baselines, measured in the same process on the same files, alternating with the arm (the files are
read once before timing so all come from the page cache):

* one streaming read of every payload byte through ``hashlib.sha256`` on one thread (8 MiB chunks);
* raw SHA-256 at the arm's own parallelism: the header block and each tensor's bytes of the same
  files, each through plain ``hashlib.sha256``, on as many threads as the arm hashes tensors with
  (largest first; 4 at most, capped by the cores).  Both arms pin their payload tensor by tensor,
  so this is the least a verifier of the same bytes pays with the same cores.

Ratio per arm: (payload bytes / arm seconds) / (payload bytes / one-thread baseline seconds), i.e.
one-thread baseline seconds / arm seconds.  Target: >= 0.9 (one read, no extra copies), judged on the
lower arm.  Also judged: ``bundle validate`` seconds / raw SHA-256 seconds at the same parallelism
<= 1.2 (``explain``'s is reported).  A full run that misses the first target profiles the arm once with
cProfile and stores the top functions in the JSON (``--profile`` forces it).

Run: ``python -m benchmarks.verify_throughput [--smoke] [--mib N] [--repeats N] [--profile]``
"""

from __future__ import annotations

import contextlib
import cProfile
import hashlib
import io
import json
import os
import pstats
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "verify_throughput"
TARGET = 0.9
TARGET_PARALLEL = 1.2  # bundle validate seconds / raw SHA-256 seconds at the same parallelism
CHUNK = 8 * 1024 * 1024
PROMPT_LEN, RESP_LEN = 16, 4096
BUNDLE_GROUPS, BUNDLE_GROUP_SIZE = 16, 8
EXPLAIN_WORKERS = 4  # replayjob.artifacts.capture_payload.MAX_WORKERS: tensors explain hashes at once
BUNDLE_WORKERS = 4  # replayjob.bundle.reader.PARALLEL_FILES: tensors bundle validate hashes at once


def hash_spans(paths: list[Path], workers: int) -> str:
    """The parallel baseline: each file's header block and each tensor's bytes through plain
    ``hashlib.sha256`` on ``workers`` threads, largest first (reads and hashing release the GIL)."""
    from replayjob.tensorfile import read_header

    local = threading.local()  # one chunk buffer per thread, as tensorfile's readers keep

    def one(job: tuple[int, int, int]) -> bytes:
        fd, begin, end = job
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(CHUNK)
        view = memoryview(buf)
        h = hashlib.sha256()
        off = begin
        while off < end:
            n = os.preadv(fd, [view[:min(len(buf), end - off)]], off)
            if n <= 0:
                raise RuntimeError("short read")
            h.update(view[:n])
            off += n
        return h.digest()

    out = []
    for p in paths:
        header = read_header(p)
        fd = os.open(p, os.O_RDONLY)
        try:
            spans = ((fd, header.data_start + t.begin, header.data_start + t.end) for t in header.tensors.values())
            jobs = [(fd, 0, header.data_start), *sorted(spans, key=lambda j: j[1] - j[2])]
            # as tensorfile.scan: threads only for files of 4 chunks or more
            n = max(1, min(workers, os.cpu_count() or 1, len(jobs))) if header.file_size >= 4 * CHUNK else 1
            with ThreadPoolExecutor(max_workers=n) as pool:
                out.append(b"".join(pool.map(one, jobs)).hex())
        finally:
            os.close(fd)
    return ",".join(out)


def _cli(argv: list[str]) -> Callable[[], None]:
    from replayjob.cli import main

    def call() -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            rc = main(argv)
        if rc != 0:
            raise RuntimeError(f"replayjob {' '.join(argv[:2])} exited {rc}: {err.getvalue()[-800:]}")
    return call


def build_explain(work: Path, nbytes: int) -> tuple[list[str], list[Path]]:
    """A real capture whose payload is swapped for a ``nbytes`` batch; return explain's argv and payload."""
    import torch

    from replayjob.artifacts import capture_manifest as manifest
    from replayjob.artifacts import capture_payload as payload
    from replayjob.cli import main
    from replayjob.fsio import atomic_write_bytes
    from replayjob.launch.workspace import init_workspace
    from replayjob.rl.batch import OptimizerBatch

    ws = work / "ws"
    init_workspace(ws, 123)
    src = ws / "source"
    with contextlib.redirect_stdout(io.StringIO()):
        if main(["capture", str(ws / "source.toml"), "--out", str(src)]) != 0:
            raise RuntimeError("the capture the explain arm starts from failed")
    mpath = src / manifest.manifest_name(0)
    doc = json.loads(mpath.read_bytes())
    per_row = 8 * (PROMPT_LEN + RESP_LEN) + 4 * 8 * RESP_LEN
    rows = max(1, nbytes // per_row)
    gen = torch.Generator().manual_seed(0)
    n_resp = rows * RESP_LEN
    old = -torch.rand(n_resp, generator=gen, dtype=torch.float64) * 3
    batch = OptimizerBatch(
        tokens=torch.randint(3, 256, (rows * (PROMPT_LEN + RESP_LEN),), generator=gen, dtype=torch.int64),
        token_offsets=torch.arange(rows + 1, dtype=torch.int64) * (PROMPT_LEN + RESP_LEN),
        prompt_lens=torch.full((rows,), PROMPT_LEN, dtype=torch.int64),
        resp_offsets=torch.arange(rows + 1, dtype=torch.int64) * RESP_LEN,
        old_logprobs=old, ref_logprobs=old - 0.01,
        advantages=torch.randn(n_resp, generator=gen, dtype=torch.float64),
        loss_weights=torch.full((n_resp,), 1.0 / n_resp, dtype=torch.float64))
    data = payload.encode(batch, {"cpu": torch.get_rng_state()})
    ppath = src / doc["payload"]["file"]
    atomic_write_bytes(ppath, data)
    doc["payload"].update(size=len(data), spans_sha256=payload.digest_bytes(data), rng_keys=["cpu"])
    doc["rows"] = payload.summary(batch)
    doc["logical_batch_sha256"] = batch.logical_sha256()
    doc["local_effective_rows_sha256"] = batch.effective_sha256()
    del data, batch
    mpath.unlink()
    msha = manifest.write(mpath, doc)
    pins = ["--set", f'optimizer_batch.expected_logical_sha256="{doc["logical_batch_sha256"]}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{msha}"']
    return ["explain", str(ws / "replay.toml"), *pins], [ppath]


def build_bundle(work: Path, nbytes: int) -> tuple[list[str], list[Path]]:
    """A synthetic rollout bundle whose payload file holds about ``nbytes``."""
    from replayjob.bundle import synthetic

    # A rollout bundle stores six [samples, width] tensors of 8-byte values; responses average
    # about half of max_len, so width is close to max_len.
    samples = BUNDLE_GROUPS * BUNDLE_GROUP_SIZE
    max_len = max(8, nbytes // (6 * 8 * samples))
    path = synthetic.write_rollout(work / "bundle", groups=BUNDLE_GROUPS, group_size=BUNDLE_GROUP_SIZE,
                                   max_len=max_len, seed=0)
    return ["bundle", "validate", str(path)], [path / "payloads.safetensors"]


def _profile(fn: Callable[[], None], top: int = 15) -> list[dict[str, Any]]:
    prof = cProfile.Profile()
    prof.runcall(fn)
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": ncalls,
                     "tottime_s": tottime, "cumtime_s": cumtime})
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return rows[:top]


def run_arm(argv: list[str], files: list[Path], repeats: int, workers: int) -> dict[str, Any]:
    """Alternate the baselines and the arm ``repeats`` times after one untimed call of each."""
    nbytes = sum(p.stat().st_size for p in files)
    arm = _cli(argv)
    base_t, par_t, arm_t, loads = [], [], [], []
    common.hash_files(files)  # warm the page cache
    hash_spans(files, workers)
    arm()              # and the arm's code paths
    for _ in range(repeats):
        loads.append(list(common.machine()["load_average"] or []))
        base_t.append(common.measure(lambda: common.hash_files(files), repeats=1, warmup=0)[0])
        par_t.append(common.measure(lambda: hash_spans(files, workers), repeats=1, warmup=0)[0])
        arm_t.append(common.measure(arm, repeats=1, warmup=0)[0])
    b, pb, a = common.stats(base_t), common.stats(par_t), common.stats(arm_t)
    out: dict[str, Any] = {
        "payload_bytes": nbytes, "files": len(files), "baseline_s": b, "parallel_baseline_s": pb, "arm_s": a,
        "parallel_workers": max(1, min(workers, os.cpu_count() or 1)),
        "baseline_mib_per_s": nbytes / 2**20 / b["median"], "arm_mib_per_s": nbytes / 2**20 / a["median"],
        "ratio": b["median"] / a["median"],
        "time_ratio": a["median"] / b["median"],
        "time_ratio_parallel": a["median"] / pb["median"],
        "load_average_per_round": loads,
        "argv": argv[:2],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--mib", type=int, default=None, help="payload MiB per arm (default 1024; smoke 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per arm (default 3; smoke 1)")
    p.add_argument("--profile", action="store_true", help="profile each arm once with cProfile")
    args = p.parse_args(argv)
    mib = args.mib or (2 if args.smoke else 1024)
    repeats = args.repeats or (1 if args.smoke else 3)
    arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="replayjob-bench-") as tmp:
        work = Path(tmp)
        for name, build, workers in (("explain", build_explain, EXPLAIN_WORKERS),
                                     ("bundle validate", build_bundle, BUNDLE_WORKERS)):
            cmd, files = build(work / name.replace(" ", "_"), mib * 2**20)
            res = run_arm(cmd, files, repeats, workers)
            if args.profile or (not args.smoke and res["ratio"] < TARGET):
                t0 = time.perf_counter()
                res["profile_top_tottime"] = _profile(_cli(cmd))
                res["profile_wall_s"] = time.perf_counter() - t0
            arms[name] = res
            for f in files:  # free the disk before the next arm
                f.unlink()
    worst = min(arms, key=lambda k: arms[k]["ratio"])
    value = arms[worst]["ratio"]
    par = arms["bundle validate"]["time_ratio_parallel"]
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=value,
        ratio_definition="arm throughput / hashlib.sha256 throughput over the same payload bytes "
                         "(baseline seconds / arm seconds); the lower of the two arms",
        baseline="one streaming read of the same payload files through hashlib.sha256 (8 MiB chunks)",
        target=common.Target(">=", TARGET, value),
        also=[common.Target("<=", TARGET_PARALLEL, par, metric="bundle validate s / raw SHA-256 s, same threads")],
        detail="; ".join(f"{k} {v['ratio']:.3f}x ({v['arm_mib_per_s']:.0f} vs {v['baseline_mib_per_s']:.0f} MiB/s"
                         f" over {v['payload_bytes'] / 2**20:.0f} MiB; {v['time_ratio_parallel']:.3f}x the time of "
                         f"raw SHA-256 on {v['parallel_workers']} threads)" for k, v in arms.items()),
        measurements={"arms": arms, "worst_arm": worst},
        parameters={"mib": mib, "repeats": repeats, "prompt_len": PROMPT_LEN, "resp_len": RESP_LEN,
                    "bundle_samples": BUNDLE_GROUPS * BUNDLE_GROUP_SIZE})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
