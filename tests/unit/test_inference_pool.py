"""`pagoda k8s-manifests --inference-pool` (wiring/inference_pool.py), checked offline: the
InferencePool and InferenceObjectives validate against the Gateway API Inference Extension's
own CRD schemas (v1.5.0, vendored in tests/fixtures/inference_extension/), strictly (a field
the schema does not know is an error, as the API server would prune it), with the CRDs' CEL
rules checked by hand; the other objects validate against Kubernetes' schemas; the pool
selects exactly the replicas' own gateways, and its endpoint picker is the one rendered."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from wiring import k8s, k8s_objects, k8s_options
from wiring.cli import build_parser
from wiring.inference_pool import EPP_CONFIG_FILE, EPP_PORT, epp_name

CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "inference_extension"
KUBERNETES_VERSION = "1.30.0"
OPTIONS = k8s_options.K8sOptions(
    replicas=3,
    pipeline_parallel_size=2,
    namespace="llm",
    inference_pool="pagoda-pool",
    objectives=(("interactive", 10), ("batch", -10)),
    served_model_names=("smol",),
)


def _strict(schema: dict) -> dict:
    """The schema with every object of known properties closed to others (the API server
    prunes unknown fields: a rendered field it does not know would be silently lost)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def _validator(crd_file: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"] and crd["spec"]["names"]["kind"] in ("InferencePool", "InferenceObjective")
    return jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))


POOL_SCHEMA = _validator("inference.networking.k8s.io_inferencepools.yaml", "v1")
OBJECTIVE_SCHEMA = _validator("inference.networking.x-k8s.io_inferenceobjectives.yaml", "v1alpha2")


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return k8s.render(OPTIONS)


def _of(manifests, kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def _check_pool_rules(pool: dict) -> None:
    """The CRD's CEL rules (x-kubernetes-validations), which JSON Schema cannot state."""
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # port required for a Service
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))  # each port once


def test_the_pool_and_objectives_validate_against_the_crds(manifests):
    (pool,) = _of(manifests, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    POOL_SCHEMA.validate(pool)
    _check_pool_rules(pool)
    objectives = _of(manifests, "InferenceObjective")
    assert {(o["metadata"]["name"], o["spec"]["priority"]) for o in objectives} == {("interactive", 10), ("batch", -10)}
    for objective in objectives:
        assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        OBJECTIVE_SCHEMA.validate(objective)
        assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "name": "pagoda-pool"}


@pytest.mark.parametrize(
    "break_it",
    [
        lambda p: p["spec"].pop("selector"),
        lambda p: p["spec"].update(targetPorts=[]),
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda p: p["spec"].update(modelServers={"matchLabels": {}}),  # a field v1 does not have
    ],
)
def test_the_schemas_catch_a_broken_pool(manifests, break_it):
    pool = copy.deepcopy(_of(manifests, "InferencePool")[0])
    break_it(pool)
    with pytest.raises(jsonschema.ValidationError):
        POOL_SCHEMA.validate(pool)


def test_the_other_objects_validate_against_kubernetes(manifests):
    for manifest in manifests:
        if not manifest["apiVersion"].startswith("inference.networking."):
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_pool_selects_exactly_the_replicas_own_gateways(manifests):
    (pool,) = _of(manifests, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    selected = [
        m
        for m in _of(manifests, "Deployment") + _of(manifests, "StatefulSet")
        if selector.items() <= m["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert sorted(m["metadata"]["name"] for m in selected) == [f"pagoda-r{i}-gateway" for i in range(3)]
    for m in selected:
        replica = m["spec"]["template"]["metadata"]["labels"][k8s_objects.REPLICA_LABEL]
        container = m["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert args[0] == "gateway" and "--routing" not in args
        assert args[args.index("--scheduler") + 1] == f"pagoda-{replica}-scheduler:{k8s_options.SCHEDULER_PORT}"
        assert args[args.index("--served-model-name") + 1] == "smol"
        http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        assert pool["spec"]["targetPorts"] == [{"number": http}]
    assert not [m for m in manifests if m["metadata"]["name"] == k8s_options.GATEWAY]  # the picker routes now


def test_the_endpoint_picker_is_the_one_the_pool_names(manifests):
    (pool,) = _of(manifests, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    name = epp_name("pagoda-pool")
    assert ref["name"] == name and ref["port"] == {"number": EPP_PORT}
    (svc,) = [s for s in _of(manifests, "Service") if s["metadata"]["name"] == name]
    assert EPP_PORT in [p["port"] for p in svc["spec"]["ports"]]
    (deploy,) = [d for d in _of(manifests, "Deployment") if d["metadata"]["name"] == name]
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    pod = deploy["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "pagoda-pool"
    assert args[args.index("--pool-namespace") + 1] == "llm"
    (config,) = [c for c in _of(manifests, "ConfigMap") if c["metadata"]["name"] == name]
    assert args[args.index("--config-file") + 1] == f"/config/{EPP_CONFIG_FILE}"
    plugins = yaml.safe_load(config["data"][EPP_CONFIG_FILE])
    assert plugins["kind"] == "EndpointPickerConfig"
    assert {p["pluginRef"] for p in plugins["schedulingProfiles"][0]["plugins"]} <= {
        p["type"] for p in plugins["plugins"]
    }
    # it reads pods, the pool and the objectives, as its service account
    assert pod["serviceAccountName"] == name
    (role,) = [r for r in _of(manifests, "Role") if r["metadata"]["name"] == name]
    assert {res for rule in role["rules"] for res in rule["resources"]} == {
        "pods",
        "inferencepools",
        "inferenceobjectives",
    }


def test_the_command_line_renders_a_pool(tmp_path):
    out = tmp_path / "pool.yaml"
    args = build_parser().parse_args(
        [
            "k8s-manifests",
            "--replicas",
            "2",
            "--inference-pool",
            "chat",
            "--inference-objective",
            "interactive=5",
            "-o",
            str(out),
        ]
    )
    assert args.func(args) == 0
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    (pool,) = _of(docs, "InferencePool")
    POOL_SCHEMA.validate(pool)
    (objective,) = _of(docs, "InferenceObjective")
    assert objective["spec"]["priority"] == 5


def test_objectives_need_a_pool_and_names_are_checked():
    with pytest.raises(ValueError, match="inference-pool"):
        k8s_options.K8sOptions(objectives=(("a", 1),))
    with pytest.raises(ValueError, match="DNS label"):
        k8s_options.K8sOptions(inference_pool="Not_A_Name")
