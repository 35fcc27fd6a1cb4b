"""Offline validation of the cluster definitions (infra/k8s/, infra/cluster/): no network, no Kubernetes.

What is validated, and with what:
- KubeRay resources (RayCluster, RayJob, RayService) against the CRD schemas vendored from KubeRay v1.7.0
  (infra/k8s/schemas/, README there), with jsonschema's Draft 7 validator extended the way the API server
  reads structural OpenAPI schemas (``nullable``, ``int32``/``int64``/``date-time`` formats, unknown fields
  refused as ``kubectl apply --validate=strict`` does, ``x-kubernetes-list-type`` uniqueness), plus a subset
  of the KubeRay operator's own checks (validation.go). CEL rules (``x-kubernetes-validations``) are not
  evaluated: no manifest may set a field that carries one.
- Each preset RayJob against jobs/presets.py (imported: a preset that changes makes these tests fail), and
  its entry point's stages parsed by the jobs' own argument parsers.
- Every Serve config (serve/config.yaml, the RayService's serveConfigV2) with Ray's ServeDeploySchema; its
  import path imported and its args built into a Serve application (``build_app``, no cluster started).
- The cluster-launcher file with Ray's own ``prepare_config`` + ``validate_config`` (what ``ray up`` runs
  before the provider's bootstrap, which needs AWS and is not run), and its node configs against botocore's
  offline EC2 ``RunInstances`` model.
- Plain Kubernetes objects (Secret, ConfigMap, PVC, Deployment, StatefulSet, Service): names, references
  between files, placeholders in the Secret templates, the platform service's args with its own parser. No
  core Kubernetes schema is vendored: their fields are not schema-checked.
Every validator has a negative case: a deliberately broken copy is refused.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
SCHEMAS = K8S / "schemas"
LAUNCHER = ROOT / "infra" / "cluster" / "p4d.yaml"
A100_PRESETS = ("a100-7b", "a100-13b", "a100-33b", "a100-70b")
GPUS_PER_NODE = 8  # p4de.24xlarge: 8 x A100-80GB (the presets' "8 x A100-80GB nodes")
KUBERAY_KINDS = {"RayCluster": "raycluster", "RayJob": "rayjob", "RayService": "rayservice"}
CORE_KINDS = {
    ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"), ("v1", "PersistentVolumeClaim"),
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"),
}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# KubeRay constant.go: MaxRayClusterNameLength 53 (63 - len("-serve-svc")); RayJob/RayService 6 less
MAX_NAME = {"RayCluster": 53, "RayJob": 47, "RayService": 47}


# ------------------------------------------------------------------------------------------------ loading


def manifests() -> dict[Path, list[dict[str, Any]]]:
    return {path: [d for d in yaml.safe_load_all(path.read_text()) if d] for path in sorted(K8S.glob("*.yaml"))}


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path, docs in manifests().items() for doc in docs]


def docs_of(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path, doc in all_docs() if doc.get("kind") == kind]


def doc_id(item: tuple[Path, dict[str, Any]]) -> str:
    return f"{item[0].name}:{item[1]['kind']}/{item[1]['metadata']['name']}"


def rayjob(preset: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((K8S / f"rayjob-{preset}.yaml").read_text()) if d]
    return doc


# ------------------------------------------------------------------------- the CRD schemas, as K8s reads them


def _int_in(bits: int):
    def check(instance: object) -> bool:
        if not isinstance(instance, int) or isinstance(instance, bool):
            return True  # formats constrain their own type only; `type` checks the rest
        return -(2 ** (bits - 1)) <= instance < 2 ** (bits - 1)
    return check


def _date_time(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    try:
        datetime.fromisoformat(instance.replace("Z", "+00:00"))
    except ValueError:
        return False
    return "T" in instance


def openapi_validator(schema: dict[str, Any]):
    """A Draft 7 validator for a Kubernetes structural schema (what is and is not checked: schemas/README.md)."""
    from jsonschema import Draft7Validator, FormatChecker, ValidationError, validators

    base = Draft7Validator.VALIDATORS

    def type_(validator, types, instance, schema):
        if instance is None and schema.get("nullable"):
            return
        yield from base["type"](validator, types, instance, schema)

    def properties(validator, props, instance, schema):
        yield from base["properties"](validator, props, instance, schema)
        if validator.is_type(instance, "object") and "additionalProperties" not in schema:
            for extra in sorted(set(instance) - set(props)):  # kubectl --validate=strict: unknown field
                yield ValidationError(f"unknown field {extra!r}")

    def list_type(validator, kind, instance, schema):
        if not validator.is_type(instance, "array"):
            return
        if kind == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in instance if isinstance(item, dict)]
        elif kind == "set":
            seen = [json.dumps(item, sort_keys=True) for item in instance]
        else:  # atomic
            return
        duplicates = sorted({str(key) for key in seen if seen.count(key) > 1})
        if duplicates:
            yield ValidationError(f"duplicate entries in a list of type {kind}: {', '.join(duplicates)}")

    formats = FormatChecker(formats=())
    formats.checks("int32")(_int_in(32))
    formats.checks("int64")(_int_in(64))
    formats.checks("date-time")(_date_time)
    cls = validators.extend(Draft7Validator, {"type": type_, "properties": properties, "x-kubernetes-list-type": list_type})
    return cls(schema, format_checker=formats)


_VALIDATORS: dict[str, Any] = {}


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Schema errors of one KubeRay resource, ``path: message`` each (empty: valid)."""
    kind = doc.get("kind")
    if kind not in _VALIDATORS:
        _VALIDATORS[kind] = openapi_validator(json.loads((SCHEMAS / f"{KUBERAY_KINDS[kind]}.v1.json").read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in _VALIDATORS[kind].iter_errors(doc)]
    if doc.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion: {doc.get('apiVersion')!r} is not ray.io/v1")
    name = doc.get("metadata", {}).get("name", "")
    if not DNS1035.match(name) or len(name) > MAX_NAME[kind]:
        errors.append(f"metadata/name: {name!r} is not a DNS-1035 label of <= {MAX_NAME[kind]} characters")
    return sorted(errors)


def cel_guarded_fields(schema: dict[str, Any], instance: Any, path: str = "") -> Iterator[str]:
    """Paths the manifest sets whose schema node carries CEL rules (x-kubernetes-validations): not evaluated."""
    if "x-kubernetes-validations" in schema:
        yield path or "."
    if isinstance(instance, dict):
        for key, value in instance.items():
            sub = schema.get("properties", {}).get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                yield from cel_guarded_fields(sub, value, f"{path}/{key}")
    elif isinstance(instance, list) and "items" in schema:
        for i, value in enumerate(instance):
            yield from cel_guarded_fields(schema["items"], value, f"{path}[{i}]")


def cluster_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]
    return {"RayCluster": [spec], "RayJob": [spec.get("rayClusterSpec")], "RayService": [spec.get("rayClusterConfig")]}[doc["kind"]]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def operator_errors(doc: dict[str, Any]) -> list[str]:
    """A subset of the KubeRay operator's checks (ray-operator/controllers/ray/utils/validation.go, v1.7.0)."""
    errors = []
    if doc["kind"] == "RayJob" and not (doc["spec"].get("rayClusterSpec") or doc["spec"].get("clusterSelector")):
        errors.append("one of RayClusterSpec or ClusterSelector must be set")
    for spec in cluster_specs(doc):
        if not spec:
            continue
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
        for name, group in groups:
            pod = group["template"].get("spec", {})
            if not pod.get("containers"):
                errors.append(f"{name}: should have at least one container")
            start = group.get("rayStartParams", {})
            if any(start.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
                errors.append(f"{name}: resource fields in both rayStartParams and resources")
            if (spec.get("autoscalerOptions") or {}).get("version") == "v2" and pod.get("restartPolicy") not in (None, "", "Never"):
                errors.append(f"{name}: restartPolicy should be Never or unset with autoscaler v2")
            if name != "head":
                low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
                if low < 0 or high < 0 or low > high:
                    errors.append(f"{name}: minReplicas {low} / maxReplicas {high}")
        if (spec.get("authOptions") or {}).get("mode", "token") == "token" and spec.get("authOptions") is not None:
            if not spec.get("rayVersion") or _version(spec["rayVersion"]) < (2, 52, 0):
                errors.append(f"authOptions.mode token needs rayVersion >= 2.52.0, got {spec.get('rayVersion')!r}")
    return errors


KUBERAY_DOCS = [item for kind in KUBERAY_KINDS for item in docs_of(kind)]


def test_every_manifest_has_a_known_kind_and_the_kuberay_kinds_are_all_there():
    kinds = {doc["kind"] for _, doc in all_docs()}
    assert {"RayCluster", "RayJob", "RayService"} <= kinds
    for path, doc in all_docs():
        if doc["kind"] in KUBERAY_KINDS:
            assert doc["apiVersion"] == "ray.io/v1", path
        else:
            assert (doc["apiVersion"], doc["kind"]) in CORE_KINDS, (path, doc["apiVersion"], doc["kind"])
        assert doc["metadata"].get("namespace") == "eagle", (path, doc["metadata"])
        assert DNS1123_SUBDOMAIN.match(doc["metadata"]["name"]), (path, doc["metadata"]["name"])
    assert sorted(p.name for p in K8S.glob("rayjob-*.yaml")) == sorted(f"rayjob-{name}.yaml" for name in A100_PRESETS)


@pytest.mark.parametrize("item", KUBERAY_DOCS, ids=doc_id)
def test_kuberay_manifest_matches_the_vendored_crd_schema(item):
    path, doc = item
    assert crd_errors(doc) == []
    assert operator_errors(doc) == []
    schema = json.loads((SCHEMAS / f"{KUBERAY_KINDS[doc['kind']]}.v1.json").read_text())
    assert list(cel_guarded_fields(schema, doc)) == [], "a field with CEL rules (not evaluated here) is set"


BROKEN = [  # (what, mutation of a RayCluster, a substring of the expected error)
    ("a string where int32 is required", lambda d: d["spec"]["workerGroupSpecs"][0].update(minReplicas="0"), "is not of type 'integer'"),
    ("an int32 out of range", lambda d: d["spec"]["workerGroupSpecs"][0].update(maxReplicas=2**31), "is not a 'int32'"),
    ("a typo in a field name", lambda d: d["spec"]["workerGroupSpecs"][0].update(maxReplica=4), "unknown field 'maxReplica'"),
    ("a typo inside the pod template", lambda d: d["spec"]["headGroupSpec"]["template"]["spec"].update(nodeSelectr={}), "unknown field 'nodeSelectr'"),
    ("a non-string rayStartParams value", lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "is not of type 'string'"),
    ("a malformed quantity", lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"].update(memory="1000 GiB"), "does not match"),
    ("two containers with one name (list-type map)",
     lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"].append(copy.deepcopy(d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])),
     "duplicate entries"),
    ("an enum value KubeRay does not know", lambda d: d["spec"]["autoscalerOptions"].update(version="v3"), "is not one of"),
    ("a missing required field", lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
    ("a wrong apiVersion", lambda d: d.update(apiVersion="ray.io/v1alpha1"), "is not ray.io/v1"),
    ("a name KubeRay refuses", lambda d: d["metadata"].update(name="Eagle_Cluster"), "DNS-1035"),
]


@pytest.mark.parametrize("what,mutate,expected", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_raycluster_is_refused_by_the_schema(what, mutate, expected):
    (_, doc), = docs_of("RayCluster")
    broken = copy.deepcopy(doc)
    mutate(broken)
    errors = crd_errors(broken)
    assert any(expected in e for e in errors), errors


def test_the_schema_validator_honours_nullable_and_date_time():
    validator = openapi_validator({"type": "object", "properties": {"t": {"type": "string", "format": "date-time", "nullable": True}}})
    assert not list(validator.iter_errors({"t": None}))
    assert not list(validator.iter_errors({"t": "2026-12-01T10:00:00Z"}))
    assert list(validator.iter_errors({"t": "yesterday"}))


def test_the_operator_checks_and_the_cel_guard_refuse_broken_copies():
    (_, doc), = docs_of("RayCluster")
    broken = copy.deepcopy(doc)
    broken["spec"]["workerGroupSpecs"][0].update(minReplicas=5, maxReplicas=4)
    broken["spec"]["rayVersion"] = "2.50.0"
    errors = operator_errors(broken)
    assert any("minReplicas 5" in e for e in errors) and any("2.52.0" in e for e in errors), errors
    guarded = copy.deepcopy(doc)
    guarded["spec"]["managedBy"] = "ray.io/kuberay-operator"
    schema = json.loads((SCHEMAS / "raycluster.v1.json").read_text())
    assert list(cel_guarded_fields(schema, guarded)) == ["/spec/managedBy"]


# ------------------------------------------------------------------------------------ the presets' RayJobs


def gpu_groups(spec: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """(worker group, GPUs per pod) of the groups whose Ray container asks for GPUs."""
    out = []
    for group in spec.get("workerGroupSpecs", []):
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        if int(limits.get("nvidia.com/gpu", 0)):
            out.append((group, int(limits["nvidia.com/gpu"])))
    return out


def stages(entrypoint: str) -> list[tuple[str, list[str]]]:
    """``python -m jobs.X args && ...`` -> [(module, args)]."""
    out = []
    for part in entrypoint.split("&&"):
        words = shlex.split(part)
        assert words[:2] == ["python", "-m"], part
        out.append((words[2], words[3:]))
    return out


def preset_mismatches(doc: dict[str, Any], preset) -> list[str]:
    """How a RayJob departs from its preset (empty: it matches)."""
    import importlib

    problems = []
    run = stages(doc["spec"]["entrypoint"])
    wanted = ["jobs.prepare_data"] + ([] if preset.train.online else ["jobs.featurize"]) + ["jobs.train_head", "jobs.evaluate"]
    if [module for module, _ in run] != wanted:
        problems.append(f"stages {[m for m, _ in run]} != {wanted} (online={preset.train.online})")
    for module, args in run:
        parsed = importlib.import_module(module).build_parser().parse_args(args)  # an unknown flag exits here
        if parsed.preset != preset.name:
            problems.append(f"{module}: --preset {parsed.preset}")
        if getattr(parsed, "workers", None) is not None:
            problems.append(f"{module}: --workers {parsed.workers} overrides the preset")
        if module == "jobs.evaluate":
            if parsed.promote_tau != preset.eval.promote_tau:
                problems.append(f"evaluate: --promote-tau {parsed.promote_tau} != preset {preset.eval.promote_tau}")
            if parsed.gpu != preset.train.use_gpu:
                problems.append(f"evaluate: --gpu {parsed.gpu} != use_gpu {preset.train.use_gpu}")
    ranks = max(preset.train.workers, 0 if preset.train.online else preset.features.workers)
    groups = gpu_groups(doc["spec"]["rayClusterSpec"])
    total = sum(group["replicas"] * gpus for group, gpus in groups)
    if total != ranks:
        problems.append(f"{total} GPUs in the RayJob's cluster != {ranks} ranks of the preset")
    for group, gpus in groups:
        if gpus != GPUS_PER_NODE:
            problems.append(f"{group['groupName']}: {gpus} GPUs per pod, not a whole 8-GPU node")
        if not group["replicas"] == group["minReplicas"] == group["maxReplicas"]:
            problems.append(f"{group['groupName']}: replicas/min/max differ (a RayJob's cluster is fixed)")
    nodes = re.search(r"(\d+) nodes? x 8 A100-80GB", preset.description)
    if not nodes or int(nodes.group(1)) != math.ceil(ranks / GPUS_PER_NODE) or sum(g["replicas"] for g, _ in groups) != int(nodes.group(1)):
        problems.append(f"node count disagrees with the preset's description {preset.description!r}")
    if doc["metadata"].get("labels", {}).get("eagle.io/preset") != preset.name:
        problems.append("label eagle.io/preset")
    return problems


@pytest.mark.parametrize("name", A100_PRESETS)
def test_preset_rayjob_matches_jobs_presets(name):
    from jobs.presets import get_preset

    preset = get_preset(name)
    assert preset.train.use_gpu and preset.features.use_gpu
    assert preset_mismatches(rayjob(name), preset) == []


def test_a_drifted_preset_or_rayjob_is_caught():
    from jobs.presets import get_preset

    preset = get_preset("a100-13b")
    drifted = preset.with_overrides(train={"workers": 16}, eval={"promote_tau": 2.5})
    problems = preset_mismatches(rayjob("a100-13b"), drifted)
    assert any("GPUs" in p for p in problems) and any("promote-tau" in p for p in problems), problems
    online = preset.with_overrides(train={"online": True})  # then jobs.featurize must go
    assert any("stages" in p for p in preset_mismatches(rayjob("a100-13b"), online))
    doc = rayjob("a100-70b")
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas=3, minReplicas=3, maxReplicas=3)
    assert any("GPUs" in p for p in preset_mismatches(doc, get_preset("a100-70b")))
    doc = rayjob("a100-7b")
    doc["spec"]["entrypoint"] = doc["spec"]["entrypoint"].replace("--promote-tau", "--promote-tau-x")
    with pytest.raises(SystemExit):  # the job's own parser refuses the flag
        preset_mismatches(doc, get_preset("a100-7b"))


def test_the_training_cluster_autoscales_from_zero_to_the_largest_preset():
    from jobs.presets import get_preset

    (_, doc), = docs_of("RayCluster")
    spec = doc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["authOptions"] == {"mode": "token", "secretName": "eagle-ray-token"}
    groups = gpu_groups(spec)
    assert groups and all(group["minReplicas"] == 0 for group, _ in groups)
    largest = max(get_preset(name).train.workers for name in A100_PRESETS)
    assert max(group["maxReplicas"] * gpus for group, gpus in groups) >= largest
    for group, _ in groups:
        pod = group["template"]["spec"]
        assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


# ------------------------------------------------------------------------------------------ Serve configs


def serve_configs() -> list[tuple[str, dict[str, Any]]]:
    configs = [("serve/config.yaml", yaml.safe_load((ROOT / "serve" / "config.yaml").read_text()))]
    for path, doc in docs_of("RayService"):
        configs.append((f"{path.name}:serveConfigV2", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return configs


@pytest.mark.parametrize("name,config", serve_configs(), ids=[c[0] for c in serve_configs()])
def test_serve_config_is_a_valid_serve_deploy_schema_with_importable_apps(name, config):
    import importlib

    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications
    for app in schema.applications:
        module, _, attr = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attr)
        assert callable(builder)
        if app.import_path == "serve.app:build_app":
            from ray.serve.deployment import Application

            assert isinstance(builder(app.args), Application)  # the project's AppArgs validate, the graph builds


def test_the_rayservice_serves_the_pairs_of_serve_config_yaml():
    (_, local), (_, service) = serve_configs()
    assert [a["args"] for a in service["applications"]] == [a["args"] for a in local["applications"]]
    assert [a["import_path"] for a in service["applications"]] == [a["import_path"] for a in local["applications"]]
    assert service["http_options"]["host"] == "0.0.0.0"


def test_a_broken_serve_config_is_refused():
    from pydantic import ValidationError

    from ray.serve.schema import ServeDeploySchema
    from serve.app import AppArgs

    _, config = serve_configs()[1]
    for mutate in (lambda c: c.update(proxy_location="Everywhere"),
                   lambda c: c["applications"][0].pop("import_path"),
                   lambda c: c["http_options"].update(port="eighty"),
                   lambda c: c["applications"].append(copy.deepcopy(c["applications"][0]))):  # two apps, one name
        broken = copy.deepcopy(config)
        mutate(broken)
        with pytest.raises(ValidationError):
            ServeDeploySchema.model_validate(broken)
    args = copy.deepcopy(config["applications"][0]["args"])
    args["pairs"][0]["num_tpus"] = 1  # not a field of serve.app.PairArgs
    with pytest.raises(ValidationError):
        AppArgs.model_validate(args)


# -------------------------------------------------------------------------------- the cluster launcher (AWS)


def launcher() -> dict[str, Any]:
    return yaml.safe_load(LAUNCHER.read_text())


def prepared(config: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(config))
    validate_config(config)
    return config


def botocore_errors(value: Any, shape, path: str) -> list[str]:
    """``value`` against a botocore shape (the EC2 model ships with botocore: offline)."""
    if shape.type_name == "structure":
        if not isinstance(value, dict):
            return [f"{path}: not a structure"]
        errors = [f"{path}.{key}: not in {shape.name}" for key in value if key not in shape.members]
        for key, sub in value.items():
            if key in shape.members:
                errors += botocore_errors(sub, shape.members[key], f"{path}.{key}")
        return errors
    if shape.type_name == "list":
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        return [e for i, item in enumerate(value) for e in botocore_errors(item, shape.member, f"{path}[{i}]")]
    if shape.type_name == "string":
        if not isinstance(value, str):
            return [f"{path}: not a string"]
        return [f"{path}: {value!r} not one of {shape.name}"] if shape.enum and value not in shape.enum else []
    if shape.type_name in ("integer", "long"):
        return [] if isinstance(value, int) and not isinstance(value, bool) else [f"{path}: not an integer"]
    if shape.type_name == "boolean":
        return [] if isinstance(value, bool) else [f"{path}: not a boolean"]
    return []


def node_config_errors(config: dict[str, Any]) -> list[str]:
    import botocore.session

    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    return [e for name, node in config["available_node_types"].items() for e in botocore_errors(node["node_config"], shape, name)]


def test_launcher_passes_rays_own_config_validation():
    config = prepared(launcher())
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    assert config["head_node_type"] in types and types[config["head_node_type"]]["max_workers"] == 0
    gpu_types = {name: t for name, t in types.items() if t["node_config"]["InstanceType"].startswith("p4d")}
    assert {t["node_config"]["InstanceType"] for t in gpu_types.values()} == {"p4d.24xlarge", "p4de.24xlarge"}
    assert all(t["min_workers"] == 0 for t in gpu_types.values())
    from jobs.presets import get_preset

    largest_nodes = max(math.ceil(get_preset(name).train.workers / GPUS_PER_NODE) for name in A100_PRESETS)
    assert types["gpu_p4de"]["max_workers"] >= largest_nodes and config["max_workers"] >= largest_nodes
    assert any("pip install" in c and "-e ~/eagle-platform" in c for c in config["setup_commands"])
    assert node_config_errors(config) == []


def test_a_broken_launcher_config_is_refused():
    from jsonschema import ValidationError

    for mutate, error in (
        (lambda c: c.update(max_workers="four"), ValidationError),
        (lambda c: c["available_node_types"]["gpu_p4d"].update(min_worker=1), ValidationError),
        (lambda c: c.update(head_node_type="nope"), ValueError),
        (lambda c: [t.update(min_workers=3) for n, t in c["available_node_types"].items() if n != "head"], ValueError),
    ):
        broken = launcher()
        mutate(broken)
        with pytest.raises(error):
            prepared(broken)
    broken = launcher()
    broken["available_node_types"]["gpu_p4de"]["node_config"]["InstanceTyp"] = "p4de.24xlarge"
    broken["available_node_types"]["gpu_p4d"]["node_config"]["InstanceType"] = "p4d.48xlarge"
    errors = node_config_errors(broken)
    assert any("InstanceTyp: not in" in e for e in errors) and any("p4d.48xlarge" in e for e in errors), errors


# ----------------------------------------------------------------- Secrets, references, the platform service


def walk(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield key, sub
            yield from walk(sub)
    elif isinstance(value, list):
        for sub in value:
            yield from walk(sub)


PLACEHOLDER_OK = {"eagle-admin", "mlflow"}  # user and database names, not secrets


def placeholder_problems(secrets: list[dict[str, Any]]) -> list[str]:
    return [f"{s['metadata']['name']}.{key}" for s in secrets for key, value in s.get("stringData", {}).items()
            if value not in PLACEHOLDER_OK and not str(value).startswith("REPLACE")]


def test_secret_templates_hold_placeholders_only_and_every_reference_resolves():
    secrets = [doc for _, doc in docs_of("Secret")]
    assert {path.name for path, _ in docs_of("Secret")} == {"secrets.example.yaml"}
    assert placeholder_problems(secrets) == []
    assert all("data" not in s for s in secrets)  # base64 `data` could hide a real value
    keys = {s["metadata"]["name"]: set(s["stringData"]) for s in secrets}
    config_maps = {doc["metadata"]["name"] for _, doc in docs_of("ConfigMap")}
    claims = {doc["metadata"]["name"] for _, doc in docs_of("PersistentVolumeClaim")}
    for path, doc in all_docs():
        for key, value in walk(doc):
            if key == "secretKeyRef" and not value.get("optional"):
                assert value["key"] in keys.get(value["name"], set()), (path.name, value)
            elif key == "secretKeyRef":  # optional: the Secret may be left out, but a named key must be in the template
                assert value["name"] in keys and value["key"] in keys[value["name"]] | {"EAGLE_S3_ENDPOINT_URL"}, (path.name, value)
            elif key == "secretRef":
                assert value["name"] in keys, (path.name, value)
            elif key == "configMapRef":
                assert value["name"] in config_maps, (path.name, value)
            elif key == "persistentVolumeClaim":
                assert value["claimName"] in claims, (path.name, value)
            elif key == "authOptions":
                assert "auth_token" in keys[value["secretName"]], (path.name, value)  # KubeRay's key
    leaked = copy.deepcopy(secrets)
    leaked[0]["stringData"]["auth_token"] = "3f1c9a0e" * 8
    assert placeholder_problems(leaked) == ["eagle-ray-token.auth_token"]


def test_services_select_their_workloads():
    labels = {doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"]
              for kind in ("Deployment", "StatefulSet") for _, doc in docs_of(kind)}
    for name, workload_labels in labels.items():
        (_, workload), = [item for kind in ("Deployment", "StatefulSet") for item in docs_of(kind) if item[1]["metadata"]["name"] == name]
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload_labels.items()
    for path, service in docs_of("Service"):
        assert any(service["spec"]["selector"].items() <= lbl.items() for lbl in labels.values()), (path.name, service["metadata"]["name"])


def test_platform_service_args_parse_with_its_own_parser():
    from eagle_platform.service import build_parser

    (_, doc), = [item for item in docs_of("Deployment") if item[1]["metadata"]["name"] == "eagle-platform"]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "eagle_platform.service"]
    args = build_parser().parse_args(container["args"])
    assert args.host == "0.0.0.0" and not args.serve  # the RayService owns Serve's config on Kubernetes
    (_, cluster), = docs_of("RayCluster")
    assert args.ray_address == f"http://{cluster['metadata']['name']}-head-svc.eagle.svc.cluster.local:8265"
    from jobs.presets import PRESETS

    assert args.default_preset in PRESETS
    env = {e["name"] for e in container["env"]}
    assert {"EAGLE_PLATFORM_TOKEN", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= env
    with pytest.raises(SystemExit):
        build_parser().parse_args(container["args"] + ["--no-such-flag"])


# -------------------------------------------------------------------------------- the GPU check (infra/gpu)

GPU_CHECK = ROOT / "infra" / "gpu" / "check.sh"


def test_the_gpu_check_fits_nine_minutes_and_runs_presets_that_exist():
    """The steps' time limits add up to at most 9 minutes, and the training preset it runs puts every stage
    on the GPU (regeneration, features, training, evaluation)."""
    from jobs.presets import get_preset

    text = GPU_CHECK.read_text()
    limits = [int(limit) for limit in re.findall(r"^\s*step [\w-]+ (\d+) ", text, flags=re.M)]
    assert len(limits) == 7 and sum(limits) <= 9 * 60
    presets = set(re.findall(r"--preset ([\w-]+)", text))
    assert presets == {"gpu-smoke"}
    preset = get_preset("gpu-smoke")
    assert preset.data.regenerate and preset.data.regen_gpus >= 1
    assert preset.features.use_gpu and preset.train.use_gpu and preset.eval.use_gpu


def test_the_gpu_check_stops_at_the_gpu_step_on_a_machine_without_one(tmp_path):
    """Run for real with no GPU visible: it records the missing GPU as a failed step in check.json and exits
    1, before starting anything."""
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "EAGLE_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(GPU_CHECK), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    result = json.loads((out / "check.json").read_text())
    assert result["passed"] is False
    assert [(s["step"], s["status"]) for s in result["steps"]] == [("gpu", "failed")]
    assert "no CUDA GPU is visible" in (out / "gpu.log").read_text()
