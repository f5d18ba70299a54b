"""`k8s resume` and the in-cluster driver read the API objects they find, adopt or create (the spec ConfigMap,
the drivers, the driver's own pod, stage Jobs) through declarations (`cluster_status.Object` and its kin): an
object that is not what the API writes is exit 3 with one line naming the object and the field, never a traceback.

The cluster is the HTTP emulator (tests/k8s_emulator.py) behind the real kubernetes client; one answer of the
API is made malformed on its way to replayjob (:func:`tamper`), everything else is as the emulator answers it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k8s_emulator import NS, Cluster, verdict_text
from kubernetes import client

from replayjob.artifacts import cluster_status as outcome
from replayjob.artifacts.spec import AblationSpec, load_spec_text
from replayjob.cli import main
from replayjob.errors import EXIT_ERROR, OperationalError
from replayjob.launch import k8s
from replayjob.launch import k8s_driver as driver
from replayjob.launch.submit import Api, submit

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
Doc = dict[str, Any]
Change = Callable[[Any], Any]


def _spec() -> tuple[AblationSpec, str]:
    return load_spec_text(SPEC)


def fast_api(api: client.ApiClient) -> Api:
    return Api(api, backoff_s=0.001, log=lambda s: None)


def tamper(monkeypatch: pytest.MonkeyPatch, call: str, change: Change) -> list[str]:
    """Make the API's JSON answer to every request whose description starts with ``call`` (``listing
    ConfigMap``, ``reading Pod``, ``creating Job``) what ``change`` makes of it; returns the calls changed."""
    changed: list[str] = []
    raw, as_dict = Api.raw, Api.as_dict

    def changed_raw(self: Api, what: str, *args: Any, **kwargs: Any) -> Any:
        doc = raw(self, what, *args, **kwargs)
        if what.startswith(call) and doc is not None:
            changed.append(what)
            return change(copy.deepcopy(doc))
        return doc

    def changed_create(self: Api, obj: Any) -> Doc:
        doc = as_dict(self, obj)
        what = f"creating {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if what.startswith(call):
            changed.append(what)
            out: Doc = change(copy.deepcopy(doc))
            return out
        return doc

    monkeypatch.setattr(Api, "raw", changed_raw)
    monkeypatch.setattr(Api, "as_dict", changed_create)
    return changed


def at(path: str, value: Any) -> Change:
    """Set ``path`` (``items/0/metadata/name``) to ``value`` (:data:`DELETE`: remove it)."""
    def change(doc: Any) -> Any:
        *parents, last = path.split("/")
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return doc
    return change


DELETE = object()
CONTAINER = "items/0/spec/template/spec/containers/0"


def one_line(err: str, said: str) -> None:
    """``err`` is the CLI's one error line (and its fix), containing ``said``; no traceback."""
    assert "Traceback" not in err and "traceback" not in err, err
    lines = [line for line in err.splitlines() if line and not line.startswith("  fix:")]
    assert len(lines) == 1, err
    assert "malformed object" in lines[0] and said in lines[0], err


def submitted(state: Cluster, api: client.ApiClient, run_id: str, *, ended: bool = True) -> None:
    """A run submitted, its driver never started (and, with ``ended``, ended without a verdict)."""
    spec, text = _spec()
    state.on_create = None
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id=run_id)
    if ended:
        state.finished[f"replayjob-ablation-{run_id}-driver"] = 3


RESUME_CASES = [
    # the run's spec ConfigMap, as listed
    ("listing ConfigMap", at("items/0/metadata", ["x"]), "items[0].metadata: expected `object`, got `array`"),
    ("listing ConfigMap", at("items/0/metadata/name", 7), "items[0].metadata.name: expected `str`, got `int`"),
    ("listing ConfigMap", at("items", {"a": 1}), "items: expected `array`, got `object`"),
    ("listing ConfigMap", at("items/0/data", ["x"]), "data: expected `object | null`, got `array`"),
    ("listing ConfigMap", at("items/0/data/ablation.toml", 5), "data[...]: expected `str`, got `int`"),
    ("listing ConfigMap", at("items/0/metadata/ownerReferences", ["x"]),
     "metadata.ownerReferences[0]: expected `object`, got `str`"),
    ("listing ConfigMap", at("items/0/metadata/ownerReferences/0/uid", DELETE),
     "metadata.ownerReferences[0]: object missing required field `uid`"),
    # its drivers, as listed
    ("listing Job", at("items/0/metadata", "x"), "items[0].metadata: expected `object`, got `str`"),
    ("listing Job", at("items/0/metadata/name", ["x"]), "items[0].metadata.name: expected `str`, got `array`"),
    ("listing Job", at("items/0/metadata/labels", "x"),
     "items[0].metadata.labels: expected `object | null`, got `str`"),
    ("listing Job", at("items/0/metadata/annotations", {k8s.SPEC_ANNOTATION: 1}),
     "items[0].metadata.annotations[...]: expected `str`, got `int`"),
    ("listing Job", at("items/0/metadata/creationTimestamp", 12), "items[0].metadata.creationTimestamp"),
    ("listing Job", at("items/0/spec/template/spec/containers", []),
     "spec.template.spec.containers: expected `array` of length >= 1"),
    ("listing Job", at("items/0/spec/template/spec", {}),
     "spec.template.spec: object missing required field `containers`"),
    ("listing Job", at("items/0/spec", None), "spec: expected `object`, got `null`"),
    ("listing Job", at(CONTAINER + "/image", DELETE), "containers[0]: object missing required field `image`"),
    ("listing Job", at(CONTAINER + "/env/0/name", DELETE),
     "containers[0].env[0]: object missing required field `name`"),
    ("listing Job", at(CONTAINER + "/env/0", "REPLAYJOB_IMAGE_REF"),
     "containers[0].env[0]: expected `object`, got `str`"),
    ("listing Job", at(CONTAINER + "/env/0/value", 3), "containers[0].env[0].value: expected `str | null`, got `int`"),
    ("listing Job", at("items/0/spec/activeDeadlineSeconds", "600"),
     "spec.activeDeadlineSeconds: expected `int | null`, got `str`"),
    # the new driver, as the API answers its create
    ("creating Job", at("metadata/uid", DELETE), "metadata: object missing required field `uid`"),
    ("creating Job", at("metadata/name", None), "metadata.name: expected `str`, got `null`"),
    ("creating Job", at("spec/template/spec/containers", {}), "spec.template.spec.containers: expected `array`"),
]


@pytest.mark.parametrize(("call", "change", "said"), RESUME_CASES)
def test_resume_names_a_malformed_object_and_field_in_one_line(
        cluster: tuple[Cluster, client.ApiClient], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], call: str, change: Change, said: str) -> None:
    state, api = cluster
    submitted(state, api, "rm")
    mark = len(state.calls)
    changed = tamper(monkeypatch, call, change)
    assert main(["k8s", "resume", "rm"]) == EXIT_ERROR
    assert changed, f"no {call} request was made"
    one_line(capsys.readouterr().err, said)
    if call != "creating Job":  # nothing was started from a malformed object
        assert not any(c.startswith("POST") for c in state.calls[mark:]), state.calls[mark:]


def test_resume_follows_a_running_driver_through_its_declaration(
        cluster: tuple[Cluster, client.ApiClient], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A driver still running is followed: its deadline is read from its declaration too."""
    state, api = cluster
    submitted(state, api, "rr", ended=False)
    tamper(monkeypatch, "listing Job", at("items/0/spec/activeDeadlineSeconds", True))
    assert main(["k8s", "resume", "rr", "--wait"]) == EXIT_ERROR
    one_line(capsys.readouterr().err, "spec.activeDeadlineSeconds: expected `int | null`, got `bool`")


@pytest.mark.parametrize(("change", "said"), [
    (at("data", "verdict"), "data: expected `object | null`, got `str`"),
    (at("data/verdict.json", 3), "data[...]: expected `str`, got `int`"),
    (at("metadata/name", 1), "metadata.name: expected `str`, got `int`"),
])
def test_resume_wait_reads_the_published_verdict_through_the_config_map_s_declaration(
        cluster: tuple[Cluster, client.ApiClient], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], change: Change, said: str) -> None:
    state, api = cluster
    submitted(state, api, "rv")
    cm = state.objects[("ConfigMap", "replayjob-ablation-rv-spec")]
    cm["data"][k8s.VERDICT_KEY] = verdict_text(0)  # as the driver publishes it
    state.finished["replayjob-ablation-rv-driver-2"] = 0  # the new driver ends with a pass
    tamper(monkeypatch, "reading configmap", change)
    assert main(["k8s", "resume", "rv", "--wait"]) == EXIT_ERROR
    err = capsys.readouterr().err
    one_line(err, said)
    assert "configmap replayjob-ablation-rv-spec" in err, err


def test_well_formed_objects_resume_as_before(cluster: tuple[Cluster, client.ApiClient],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The new driver copies the image and the GPU product its run's last driver ran with (an overlay's), and
    follows the run to the verdict it publishes."""
    state, api = cluster
    submitted(state, api, "rw")
    first = state.objects[("Job", "replayjob-ablation-rw-driver")]
    (cont,) = first["spec"]["template"]["spec"]["containers"]
    cont["image"] = "registry.example/replayjob@sha256:" + "a" * 64
    gpu = next(e for e in cont["env"] if e["name"] == "REPLAYJOB_GPU_PRODUCT")
    gpu["value"] = "NVIDIA-H200"
    state.objects[("ConfigMap", "replayjob-ablation-rw-spec")]["data"][k8s.VERDICT_KEY] = verdict_text(0)
    state.finished["replayjob-ablation-rw-driver-2"] = 0
    assert main(["k8s", "resume", "rw", "--wait"]) == 0
    second = state.objects[("Job", "replayjob-ablation-rw-driver-2")]
    (mine,) = second["spec"]["template"]["spec"]["containers"]
    assert mine["image"] == cont["image"]
    env = {e["name"]: e for e in mine["env"]}
    assert env["REPLAYJOB_GPU_PRODUCT"] == {"name": "REPLAYJOB_GPU_PRODUCT", "value": "NVIDIA-H200"}
    first_env = {e["name"]: e for e in cont["env"]}
    assert env["REPLAYJOB_RUN_ID"] == first_env["REPLAYJOB_RUN_ID"]  # the run's id, as its first driver had it
    owners = [r["name"] for r in state.objects[("ConfigMap", "replayjob-ablation-rw-spec")]["metadata"]
              ["ownerReferences"]]
    assert owners == ["replayjob-ablation-rw-driver", "replayjob-ablation-rw-driver-2"]
    assert "started job/replayjob-ablation-rw-driver-2" in capsys.readouterr().out


def drive(state: Cluster, api: client.ApiClient, tmp_path: Path, run_id: str, *, pod: str = "") -> int:
    """The in-cluster driver of ``run_id`` (submitted: its ConfigMap exists), run here."""
    spec, text = _spec()
    claim = tmp_path / "claim"
    (claim / "runs" / spec.name / run_id).mkdir(parents=True, exist_ok=True)
    (claim / "runs" / spec.name / run_id / "verdict.json").write_text(str(verdict_text(0)), encoding="utf-8")
    me = state.objects[("Job", f"replayjob-ablation-{run_id}-driver")]
    ctx = driver.Context(namespace=NS, job=me["metadata"]["name"], uid=me["metadata"]["uid"], pod=pod,
                         run_id=run_id, gpu_product="", image=spec.image, artifacts=str(claim))
    return driver.drive(spec, text, ctx, fast_api(api), poll_s=0.001, log=lambda s: None)


def a_pod(state: Cluster, name: str) -> None:
    spec, _ = _spec()
    state.add({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
               "spec": {"containers": [{"name": k8s.CONTAINER, "image": spec.image}]}})


def a_capture(state: Cluster, run_id: str) -> None:
    """The run's capture Job, created and finished by an earlier driver of the run."""
    spec, _ = _spec()
    first = state.objects[("Job", f"replayjob-ablation-{run_id}-driver")]
    state.add(k8s.stage_jobs(spec, run_id, k8s.owner_reference(first))["capture.yaml"])


DRIVE_CASES = [
    # the driver's own pod (the image every stage runs)
    ("reading Pod", at("spec/containers", []), "pod drv-pod: malformed object: spec.containers: expected `array` "
                                               "of length >= 1"),
    ("reading Pod", at("spec/containers/0/name", DELETE), "spec.containers[0]: object missing required field `name`"),
    ("reading Pod", at("spec/containers/0/image", 5), "spec.containers[0].image: expected `str`, got `int`"),
    ("reading Pod", at("spec", DELETE), "pod drv-pod: malformed object: the object: object missing required field "
                                        "`spec`"),
    ("reading Pod", at("metadata", []), "metadata: expected `object`, got `array`"),
    # its own Job (labelled with the run id)
    ("reading Job replayjob-ablation-rd-driver", at("metadata/labels", ["x"]),
     "metadata.labels: expected `object | null`, got `array`"),
    ("reading Job replayjob-ablation-rd-driver", at("metadata/name", 3), "metadata.name: expected `str`, got `int`"),
    # the run's drivers (the owners of what it adopts)
    ("listing Job", at("items/0/metadata/uid", 5), "items[0].metadata.uid: expected `str | null`, got `int`"),
    # the run's spec ConfigMap, adopted
    ("reading ConfigMap", at("data", "x"), "configmap replayjob-ablation-rd-spec: malformed object: data: expected "
                                           "`object | null`, got `str`"),
    ("reading ConfigMap", at("metadata/ownerReferences", [{"name": "x"}]),
     "metadata.ownerReferences[0]: object missing required field `uid`"),
    ("reading ConfigMap", at("metadata/ownerReferences", {"uid": "x"}),
     "metadata.ownerReferences: expected `array | null`, got `object`"),
    # a stage Job the run created before, adopted
    ("reading Job replayjob-ablation-rd-capture", at("metadata/ownerReferences", ["x"]),
     "metadata.ownerReferences[0]: expected `object`, got `str`"),
    ("reading Job replayjob-ablation-rd-capture", at("spec", ["x"]), "spec: expected `object | null`, got `array`"),
    ("reading Job replayjob-ablation-rd-capture", at("metadata/labels", {"a": 1}),
     "metadata.labels[...]: expected `str`, got `int`"),
    # a stage Job as the API answers its create
    ("creating Job replayjob-ablation-rd-replay", at("metadata/uid", 9), "metadata.uid: expected `str`, got `int`"),
]


@pytest.mark.parametrize(("call", "change", "said"), DRIVE_CASES)
def test_the_driver_names_a_malformed_object_and_field_in_one_line(
        cluster: tuple[Cluster, client.ApiClient], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        call: str, change: Change, said: str) -> None:
    state, api = cluster
    submitted(state, api, "rd", ended=False)
    a_pod(state, "drv-pod")
    a_capture(state, "rd")
    changed = tamper(monkeypatch, call, change)
    with pytest.raises(OperationalError) as info:
        drive(state, api, tmp_path, "rd", pod="drv-pod")
    assert changed, f"no {call} request was made"
    exc = info.value
    assert exc.exit_code == EXIT_ERROR
    assert "\n" not in exc.message and "malformed object" in exc.message and said in exc.message, exc.message


def test_the_driver_adopts_well_formed_objects_as_before(cluster: tuple[Cluster, client.ApiClient],
                                                         tmp_path: Path) -> None:
    state, api = cluster
    submitted(state, api, "ra", ended=False)
    a_pod(state, "drv-pod")
    a_capture(state, "ra")
    assert drive(state, api, tmp_path, "ra", pod="drv-pod") == 0
    capture = state.objects[("Job", "replayjob-ablation-ra-capture")]
    assert [r["name"] for r in capture["metadata"]["ownerReferences"]] == ["replayjob-ablation-ra-driver"]
    assert "CONFLICT jobs replayjob-ablation-ra-capture" in state.calls  # adopted, not created again
    assert state.objects[("Job", "replayjob-ablation-ra-driver")]["metadata"]["labels"][k8s.RUN_ID_LABEL] == "ra"


def test_read_object_names_what_and_where() -> None:
    with pytest.raises(OperationalError) as info:
        outcome.read_object({"metadata": {"name": 1}}, outcome.Object, "job j", where="namespace n")
    assert info.value.diagnostics().splitlines()[0] == \
        "namespace n: job j: malformed object: metadata.name: expected `str`, got `int`"
    with pytest.raises(OperationalError, match="job j: malformed object: the object: expected `object`, got `array`"):
        outcome.read_object([], outcome.Object, "job j")
