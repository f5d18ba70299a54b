"""The ablation spec (the fan-out's single source of truth) and `replayjob k8s render`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from replayjob.artifacts.spec import DETERMINISM_ENV, AblationSpec, Arm, Run, Value, load_spec
from replayjob.cli import main
from replayjob.errors import ConfigError
from replayjob.runtime import determinism

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
MINIMAL = """
name = "demo"
image = "replayjob:0.1.0"
image_policy = "local"
gpu_product = "NVIDIA-H100-80GB-HBM3"
storage_class = "nfs-rwx"
repeats = 2
[arms.ckpt-off]
[arms.ckpt-on]
"backend.options.gradient_checkpointing" = true
"""


def stages(path: Path) -> dict[str, Any]:
    """The stage Jobs the driver creates for the spec at ``path`` (run id r1)."""
    from replayjob.launch import k8s

    return k8s.stage_jobs(load_spec(path), "r1")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "ablation.toml"
    p.write_text(text, encoding="utf-8")
    return p


def test_example_spec_loads_with_its_arms_and_index_mapping() -> None:
    spec = load_spec(SPEC)
    assert [a.name for a in spec.arms] == ["ckpt-off", "ckpt-on"]
    assert spec.size == 6 and spec.effective_min_repeats == 3
    assert spec.runs()[0] == Run("ckpt-off", 0, 0)
    assert spec.run_for_index(4) == Run("ckpt-on", 1, 4)
    assert [spec.run_for_index(i) for i in range(spec.size)] == spec.runs()
    assert len({(r.arm, r.repeat) for r in spec.runs()}) == spec.size
    with pytest.raises(ConfigError, match=r"outside 0\.\.5"):
        spec.run_for_index(6)
    on = spec.arm("ckpt-on")
    assert on.set_args() == ["backend.options.gradient_checkpointing=true"]
    assert on.allow_list() == '["backend.options.gradient_checkpointing"]'
    assert spec.arm("ckpt-off").allow_list() == "[]"
    assert spec.config_sets() == ['backend.devices="cuda"']


def test_arm_overrides_render_as_toml_values() -> None:
    arm = Arm("x", {"training.micro_batch_size": 2, "backend.options.attn_implementation": "sdpa"})
    assert arm.set_args() == ['backend.options.attn_implementation="sdpa"', "training.micro_batch_size=2"]
    assert arm.words() == 'backend.options.attn_implementation="sdpa" training.micro_batch_size=2'


def test_determinism_env_is_accepted_by_the_strict_controls(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DETERMINISM_ENV["CUBLAS_WORKSPACE_CONFIG"] in determinism.CUBLAS_OK
    monkeypatch.setenv(determinism.ENV_MATH_MODE, DETERMINISM_ENV[determinism.ENV_MATH_MODE])
    assert determinism.math_mode_from_env(strict=True) == "pedantic"
    assert set(DETERMINISM_ENV) == {"CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "PYTHONHASHSEED",
                                    "REPLAYJOB_MATH_MODE", "NCCL_ALGO", "NCCL_PROTO"}
    # the NCCL settings that change how ranks sum are pinned (algorithm, protocol) or recorded (all)
    assert {"NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_NVLS_ENABLE"} <= set(determinism.NCCL_NUMERICS)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "4")
    snap = determinism.snapshot()
    assert (snap["nccl_algo"], snap["nccl_max_nchannels"]) == ("Ring", "4")


def test_a_render_needs_a_storage_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ReadWriteMany claim on a default class that only offers ReadWriteOnce never binds, and every
    pod stays Pending without an error: the class is named, or nothing is rendered."""
    spec = write(tmp_path, MINIMAL.replace('storage_class = "nfs-rwx"\n', ""))
    assert main(["k8s", "render", str(spec), "--setup", str(tmp_path / "setup")]) == 2
    assert "a storage class is required" in capsys.readouterr().err and not (tmp_path / "setup").exists()
    assert main(["step", "plan", "--spec", str(spec)]) == 0  # outside a render it is not needed


def test_cpu_and_memory_are_per_rank_and_the_pod_s_threads_are_shared_among_its_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.artifacts.spec import scale_quantity
    from replayjob.runtime.slurm_ranks import rank_thread_env

    assert [scale_quantity(q, n) for q, n in (("8", 4), ("64Gi", 2), ("0.5", 3), ("500m", 4), ("1.25", 4))] == [
        "32", "128Gi", "1.5", "2000m", "5"]
    text = "ranks = 2\n" + MINIMAL + '[config]\n"distributed.strategy" = "ddp"\n'
    jobs = list(stages(write(tmp_path, text)).values())
    requests = [d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] for d in jobs]
    assert requests[:2] == [{"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "2"}] * 2  # capture, replays
    assert requests[2] == {"cpu": "1", "memory": "4Gi"}  # the reducer runs one process
    pod = {"OMP_NUM_THREADS": "16", "MKL_NUM_THREADS": "16"}
    assert rank_thread_env(pod, 2, "torchrun") == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert rank_thread_env({"OMP_NUM_THREADS": "3"}, 4, "torchrun")["OMP_NUM_THREADS"] == "1"
    assert rank_thread_env(pod, 2, "srun") == {} and rank_thread_env(pod, 1, "torchrun") == {}


@pytest.mark.parametrize(("edit", "message"), [
    ("colour = 3\n", "unknown key"),
    ('seed = true\n', "must be int"),
    ('claim = "vibes"\n', "not a claim"),
    ('device = "tpu"\n', "'tpu'"),
    ('storage = "lots"\n', "not a Kubernetes quantity"),
    ('[arms.Bad_Arm]\n', "DNS label"),
    ('[arms.lr]\n"optimizer.lr" = 0.1\n', "not a systems-only knob"),
    ('[arms.spaces]\n"backend.options.attn_implementation" = "s dpa"\n', "without spaces"),
    *((f'[arms.odd]\n"backend.options.gradient_checkpointing" = {v}\n', "finite numbers") for v in ("nan", "-inf")),
    ('[config]\n"optimizer_batch.ring_size" = inf\n', "finite numbers"),
    ('[config]\n"seed" = 1\n', "not a dotted config key"),
    ('model_path = "/artifacts/models/m"\n', "needs its own resume state"),
])
def test_spec_refuses_what_it_cannot_fan_out(tmp_path: Path, edit: str, message: str) -> None:
    head, arms = MINIMAL.split("[arms.ckpt-off]")
    text = head + edit + "[arms.ckpt-off]" + arms if not edit.startswith("[") else MINIMAL + edit
    with pytest.raises(ConfigError, match=message):
        load_spec(write(tmp_path, text))


@pytest.mark.parametrize(("key", "value", "message"), [
    # rendered into a node selector: a label value, or a key; an empty product matches no GPU node
    ("gpu_product", "NVIDIA:H100", "must be a label value"),
    ("gpu_product", "x@y", "must be a label value"),
    ("gpu_product", "NVIDIA-H100-80GB-HBM3-" + "x" * 50, "must be a label value"),
    ("gpu_product", "", "an empty value matches no GPU node"),
    ("driver_version", "580:1", "must be a label value"),
    ("driver_label", "a:b", "must be a label key"),
    ("driver_label", "Nvidia.com/x", "must be a label key"),
    ("driver_label", "", "must be a label key"),
    # naming an object: a lowercase DNS subdomain
    ("priority_class", "High_Prio", "PriorityClass name"),
    ("claim_name", "My_Claim", "PersistentVolumeClaim name"),
    ("claim_name", "", "PersistentVolumeClaim name"),
    ("storage_class", "Fast:SSD", "StorageClass name"),
    # a name that begins a JobSet's headless Service's: a DNS-1035 label, a letter first
    ("name", "1abc", "starting with a letter"),
    # quantities no pod runs in: nothing, or a fraction of a byte ('m' is milli)
    ("memory", "64m", "0.064 bytes, not a whole number \\('m' is milli"),
    ("shm", "8m", "not a whole number"),
    ("storage", "0.5", "0.5 bytes, not a whole number: "),
    ("memory", "0", "is nothing"),
    ("cpu", "0", "is nothing"),
    # what Kubernetes does not count: a fraction of a millicore, more than a 64-bit count for a pod of ranks
    ("cpu", "0.5m", "finer than a thousandth of a CPU"),
    ("cpu", "0.0001", "finer than a thousandth of a CPU"),
    ("cpu", "200000000000000", "more than Kubernetes counts: a request is a 64-bit count of millicores"),
    ("memory", "200000Ti", "more than Kubernetes counts: a request is a 64-bit count of bytes"),
    ("storage", "99999999999999999999", "64-bit count of bytes"),
])
def test_spec_refuses_a_name_or_label_the_api_server_refuses(tmp_path: Path, key: str, value: str,
                                                             message: str) -> None:
    lines = [line for line in MINIMAL.splitlines() if not line.startswith(f"{key} =")]
    with pytest.raises(ConfigError, match=message):
        load_spec(write(tmp_path, f'{key} = "{value}"\n' + "\n".join(lines) + "\n"))


@pytest.mark.parametrize(("edit", "message"), [
    ("repeats = 50001\n", "2 arms x 50001 repeats are 100002 replays: Kubernetes runs at most 100000"),
    ("repeats = 9223372036854775807\n", "at most 100000"),  # refused before anything counts the replays
    ("deadline_s = 9223372036854775807\n", "more than a year"),
    ("deadline_s = 31622401\n", "more than a year"),
])
def test_spec_refuses_counts_no_cluster_runs(tmp_path: Path, edit: str, message: str) -> None:
    lines = [line for line in MINIMAL.splitlines() if not line.startswith(edit.split(" ")[0] + " =")]
    with pytest.raises(ConfigError, match=message):
        load_spec(write(tmp_path, edit + "\n".join(lines) + "\n"))


def test_spec_refuses_min_repeats_above_repeats_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="between 0"):
        load_spec(write(tmp_path, MINIMAL.replace("repeats = 2", "repeats = 2\nmin_repeats = 3")))
    with pytest.raises(ConfigError, match="not found"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_spec(write(tmp_path, "name = [\n"))
    with pytest.raises(ConfigError, match=r"\[arms\]"):
        load_spec(write(tmp_path, MINIMAL.split("[arms")[0]))


def test_k8s_render_prints_and_writes_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write(tmp_path, MINIMAL)
    assert main(["k8s", "render", str(spec)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("PersistentVolumeClaim", "replayjob-artifacts"), ("ServiceAccount", "demo-driver"), ("Role", "demo-driver"),
        ("RoleBinding", "demo-driver"), ("ConfigMap", "demo-spec"), ("Job", "demo-driver")]
    assert docs[4]["data"]["ablation.toml"] == MINIMAL  # the pods parse the spec itself, strictly
    replay = stages(spec)["replay.yaml"]["spec"]  # what the driver creates
    assert (replay["completions"], replay["parallelism"], "suspend" in replay) == (4, 4, False)
    out, wf, setup, wf_setup = tmp_path / "base", tmp_path / "wf.yaml", tmp_path / "setup", tmp_path / "wfs.yaml"
    assert main(["k8s", "render", str(spec), "--out", str(out), "--argo", str(wf), "--setup", str(setup),
                 "--argo-setup", str(wf_setup)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "driver.yaml", "kustomization.yaml", "kustomizeconfig.yaml", "spec.yaml"]
    assert sorted(p.name for p in setup.iterdir()) == [
        "kustomization.yaml", "pvc.yaml", "role.yaml", "rolebinding.yaml", "serviceaccount.yaml"]
    kinds = [d["kind"] for d in yaml.safe_load_all(wf.read_text(encoding="utf-8"))]
    assert kinds == ["WorkflowTemplate", "Workflow"]
    kinds = [d["kind"] for d in yaml.safe_load_all(wf_setup.read_text(encoding="utf-8"))]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim"]


@pytest.mark.parametrize("brk", ["\n", "\r", "\x85", "\u2028"])
def test_a_path_with_a_line_break_puts_no_yaml_into_the_manifests(tmp_path: Path, brk: str) -> None:
    """The header comment names the spec and the output paths: a line break in one is written escaped."""
    def render(where: Path) -> dict[str, list[str]]:
        where.mkdir()
        spec = where / "ablation.toml"
        spec.write_text(MINIMAL, encoding="utf-8")
        assert main(["k8s", "render", str(spec), "--out", str(where / "base"), "--argo", str(where / "wf.yaml"),
                     "--setup", str(where / "setup"), "--argo-setup", str(where / "wfs.yaml")]) == 0
        return {str(p.relative_to(where)): [line for line in p.read_text(encoding="utf-8").splitlines()
                                            if not line.startswith("#")]  # YAML's lines, as YAML splits them
                for p in where.rglob("*.yaml")}

    plain, odd = render(tmp_path / "plain"), render(tmp_path / f"x{brk}kind: Secret{brk}y")
    assert odd == plain


def test_gpu_placement_options_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = MINIMAL.replace("repeats = 2", 'repeats = 2\nnode_gpus = 8\ndriver_version = "580"\n'
                           'priority_class = "gpu-batch"\nsemaphore = "gpu-pool/h100"\nparallelism = 3')
    spec = write(tmp_path, text)
    assert main(["k8s", "render", str(spec), "--argo", str(tmp_path / "wf.yaml")]) == 0
    replay = stages(spec)["replay.yaml"]
    pod = replay["spec"]["template"]["spec"]
    assert replay["metadata"]["name"] == "demo-r1-replay"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                   "nvidia.com/cuda.driver.major": "580"}
    assert pod["priorityClassName"] == "gpu-batch" and replay["spec"]["parallelism"] == 3
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    wft = next(iter(yaml.safe_load_all((tmp_path / "wf.yaml").read_text(encoding="utf-8"))))
    replay = next(t for t in wft["spec"]["templates"] if t["name"] == "replay")
    assert replay["synchronization"] == {"semaphores": [{"configMapKeyRef": {"name": "gpu-pool", "key": "h100"}}]}
    with pytest.raises(ConfigError, match="CONFIGMAP/KEY"):
        load_spec(write(tmp_path, MINIMAL.replace("repeats = 2", 'repeats = 2\nsemaphore = "nokey"')))


DIGEST = "registry.example.org/ml/replayjob@sha256:" + "a" * 64


def test_a_render_for_a_cluster_refuses_an_image_without_a_digest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tag may name other bytes tomorrow (and the default one exists in no registry): rendering for a
    cluster needs the digest, unless the spec declares local development.  Outside a render (plan, the
    funnel, a workstation's steps) a tag stays accepted."""
    tag = write(tmp_path, MINIMAL.replace('image_policy = "local"\n', ""))
    for args in (["--out", str(tmp_path / "k8s")], ["--argo", str(tmp_path / "wf.yaml")], []):
        assert main(["k8s", "render", str(tag), *args]) == 2
        err = capsys.readouterr().err
        assert "'replayjob:0.1.0' is not named by its digest" in err and "image_policy" in err
    assert not (tmp_path / "k8s").exists() and not (tmp_path / "wf.yaml").exists()
    assert main(["step", "plan", "--spec", str(tag)]) == 0
    capsys.readouterr()
    pinned = write(tmp_path, MINIMAL.replace('image = "replayjob:0.1.0"\nimage_policy = "local"',
                                             f'image = "{DIGEST}"'))
    assert load_spec(pinned).image_policy == "digest"
    assert main(["k8s", "render", str(pinned), "--out", str(tmp_path / "k8s")]) == 0
    assert f"image: {DIGEST}" in (tmp_path / "k8s" / "driver.yaml").read_text(encoding="utf-8")
    for bad in ("sha256:" + "a" * 64, "replayjob@sha256:" + "A" * 64, "replayjob@sha256:abc"):
        with pytest.raises(ConfigError, match="not named by its digest"):
            dataclasses.replace(load_spec(pinned), image=bad).check_cluster()
    with pytest.raises(ConfigError, match="not an image policy"):
        load_spec(write(tmp_path, MINIMAL.replace('"local"', '"sometimes"')))


def test_k8s_render_refuses_a_bad_spec_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", str(write(tmp_path, MINIMAL + "[arms.x]\n\"optimizer.lr\" = 1.0\n"))]) == 2
    assert "not a systems-only knob" in capsys.readouterr().err


def test_render_needs_no_model_libraries() -> None:
    """`k8s render` runs on any machine: transformers, peft and torch stay unimported."""
    import subprocess
    import sys

    probe = ("import sys, io, contextlib\nfrom replayjob.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    rc = main(sys.argv[1:])\n"
             "print(rc, sorted(m for m in ('transformers', 'peft', 'torch') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", probe, "k8s", "render", str(SPEC)], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == "0 []", proc.stderr


# --- ranks: the capture's world size and each arm's ------------------------------------------------

def ranked(ranks: int = 2, node_gpus: int = 0, device: str = "cuda", strategy: str | None = "ddp",
           **worlds: object) -> AblationSpec:
    """A spec built directly (an arm's ``distributed.world_size`` is checked here, by the dataclass)."""
    config: dict[str, Value] = {} if strategy is None else {"distributed.strategy": strategy}
    arms = (Arm("same"), *(Arm(name, {"distributed.world_size": w}) for name, w in worlds.items()))  # type: ignore[misc]
    return AblationSpec(name="ranks", image="replayjob:0.1.0", gpu_product="NVIDIA-H100-80GB-HBM3", arms=arms,
                        repeats=2, ranks=ranks, node_gpus=node_gpus, device=device, config=config)


def test_ranks_default_to_one_and_every_replay_runs_the_capture_s_count(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, MINIMAL))
    assert spec.ranks == 1 and spec.rank_groups() == {1: [0, 1, 2, 3]}
    two = load_spec(write(tmp_path, "ranks = 2\n" + MINIMAL + '[config]\n"distributed.strategy" = "ddp"\n'))
    assert [two.ranks_for_index(i) for i in range(two.size)] == [2, 2, 2, 2]
    assert two.rank_groups() == {2: [0, 1, 2, 3]} and two.arm_ranks("ckpt-on") == 2


def test_an_arm_s_world_size_sets_its_replays_ranks() -> None:
    spec = ranked(2, one=1, four=4)
    assert [spec.arm_ranks(a.name) for a in spec.arms] == [2, 1, 4]
    assert spec.rank_groups() == {1: [2, 3], 2: [0, 1], 4: [4, 5]}  # ascending counts, indexes in order
    assert [spec.ranks_for_index(i) for i in range(spec.size)] == [2, 2, 1, 1, 4, 4]
    paired = dataclasses.replace(spec, schedule="abba")  # the groups follow the schedule's index order
    assert all(paired.ranks_for_index(i) == paired.arm_ranks(paired.run_for_index(i).arm)
               for i in range(paired.size))
    assert sorted(i for ix in paired.rank_groups().values() for i in ix) == list(range(paired.size))
    assert ranked(1, strategy=None).rank_groups() == {1: [0, 1]}  # one process needs no strategy
    assert ranked(8, node_gpus=8).rank_groups() == {8: [0, 1]}
    assert ranked(4, node_gpus=2, device="cpu").nodes_for(4) == (1, 4)  # node_gpus counts GPUs only
    assert ranked(4, node_gpus=2).nodes_for(4) == (2, 2)  # more ranks than a node's GPUs: several nodes
    assert ranked(2, node_gpus=8, big=16).nodes_for(16) == (2, 8) and ranked(2, node_gpus=8).nodes_for(8) == (1, 8)
    assert ranked(2, node_gpus=8, twelve=12).nodes_for(12) == (2, 6)  # the fewest nodes, as many ranks on each


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ranks": 0}, "between 1 and 64"),
    ({"ranks": 65}, "between 1 and 64"),
    ({"ranks": 2, "strategy": None}, "the capture runs 2 ranks but distributed.strategy is 'none'"),
    ({"ranks": 2, "strategy": "none"}, "distributed.strategy is 'none'"),
    ({"ranks": 1, "strategy": None, "two": 2}, "the arm two runs 2 ranks but distributed.strategy"),
    ({"ranks": 3, "node_gpus": 2}, "the capture runs 3 ranks, one GPU each, over 2 nodes of node_gpus = 2"),
    ({"ranks": 2, "node_gpus": 2, "big": 5}, "the arm big runs 5 ranks, one GPU each, over 3 nodes of node_gpus = 2"),
    ({"zero": 0}, "must be an integer between 1 and 64, found 0"),
    ({"flag": True}, "found True"),
    ({"text": "2"}, "found '2'"),
    ({"frac": 1.5}, "found 1.5"),
    ({"ranks": 2, "same2": 2}, "distributed.world_size = 2 is the capture's ranks: no difference to declare"),
    ({"ranks": 1, "strategy": None, "same1": 1}, "distributed.world_size = 1 is the capture's ranks"),
])
def test_rank_counts_are_validated_strictly(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ranked(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("edit", "message"), [
    ("ranks = 0\n", "between 1 and 64"),
    ('ranks = "2"\n', "must be int, not str"),
    ("ranks = 2\n", "distributed.strategy is 'none'"),
    ('[config]\n"distributed.world_size" = 2\n', "set it once, as ranks"),
])
def test_spec_file_refuses_bad_ranks_by_key(tmp_path: Path, edit: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_spec(write(tmp_path, MINIMAL + edit if edit.startswith("[") else edit + MINIMAL))
    assert str(tmp_path / "ablation.toml") in (info.value.where or "")


def test_a_spec_file_declares_an_arm_s_world_size_as_a_registered_knob(tmp_path: Path) -> None:
    text = ("ranks = 2\n" + MINIMAL + '[arms.one-rank]\n"distributed.world_size" = 1\n'
            '[config]\n"distributed.strategy" = "ddp"\n')
    spec = load_spec(write(tmp_path, text))
    assert spec.rank_groups() == {1: [4, 5], 2: [0, 1, 2, 3]}
    assert spec.arm("one-rank").allow_list() == '["distributed.world_size"]'  # declared, so the gate admits it
    with pytest.raises(ConfigError, match="the arm one-rank runs 3 ranks, one GPU each, over 2 nodes of node_gpus = 2"):
        load_spec(write(tmp_path, text.replace("= 1\n[config]", "= 3\n[config]").replace("ranks = 2", "ranks = 2\n"
                                                                                           "node_gpus = 2")))


@pytest.mark.parametrize(("old", "new"), [
    ('name = "demo"', 'name = "demo\\n"'),
    ('[arms.ckpt-on]', '["arms"."ckpt-on\\n"]'),
    ('image = "replayjob:0.1.0"', 'image = "replayjob:0.1.0\\n"'),
    ('repeats = 2', 'repeats = 2\n[config]\n"backend.options.attn_implementation" = "sdpa\\n"'),
])
def test_a_trailing_newline_is_refused_at_plan_and_render(tmp_path: Path, old: str, new: str) -> None:
    """Full-string matching: `$` also matches before a final newline, so names, the image and [config]
    values ending in one passed validation and were refused only at `step reduce`, after the replays."""
    assert old in MINIMAL
    spec = write(tmp_path, MINIMAL.replace(old, new))
    with pytest.raises(ConfigError):
        load_spec(spec)
    assert main(["step", "plan", "--spec", str(spec)]) == 2
    assert main(["k8s", "render", str(spec), "--out", str(tmp_path / "k8s")]) == 2
    assert not (tmp_path / "k8s").exists()


def test_slots_and_bare_names_are_matched_over_the_whole_string() -> None:
    from replayjob.artifacts.schedule import parse_slot
    from replayjob.errors import ReplayjobError, UsageError

    assert parse_slot("abba:1:2:3").block == 2
    with pytest.raises(UsageError):
        parse_slot("abba:1:2:3\n")
    from replayjob.artifacts import metrics
    with pytest.raises(ReplayjobError, match="bare file name"):
        metrics._manifest_name({metrics.MANIFEST_PATH: "manifest.json\n"}, Path("metrics.json"))
