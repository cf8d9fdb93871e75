"""`pagoda k8s-manifests --inference-pool NAME`: the replicas as the model servers of an
InferencePool (the Kubernetes Gateway API Inference Extension, v1.5.0), which a Gateway
(Envoy Gateway, Istio, GKE, kgateway, ...) routes to through the extension's endpoint picker.

In this mode each replica has its own gateway (`pagoda-rN-gateway`: OpenAI HTTP on :8000, one
scheduler behind it; wiring/k8s.py renders it) and Pagoda's router gateway is not rendered:
the endpoint picker (EPP) takes its place, picking a replica per request from the metrics each
replica's gateway exports under the names the EPP reads by default (docs/metrics.md "For an
endpoint picker": queue, running requests, KV usage, the KV layout, LoRA adapters). Rendered
here, beside the replicas:

    InferencePool NAME (inference.networking.k8s.io/v1): the replicas' gateways on :8000,
        the endpoint picker NAME-epp:9002
    InferenceObjective per --inference-objective (inference.networking.x-k8s.io/v1alpha2)
    NAME-epp: the endpoint picker's ConfigMap (its scorers: queue, KV usage, prefix cache),
        ServiceAccount, Role and RoleBinding (read pods, the pool, the objectives), Deployment
        and Service (ext-proc gRPC :9002, health :9003, metrics :9090)

The cluster needs the extension's CRDs (its release's manifests) and a Gateway whose HTTPRoute
sends to the pool (docs/deploy.md). tests/unit/test_inference_pool.py validates the pool and
objectives against the CRDs' schemas (vendored in tests/fixtures/inference_extension/).
"""

from __future__ import annotations

from typing import Any

import yaml

from wiring.k8s_objects import (
    NAME_LABEL,
    HasNamespace,
    container_security,
    deployment,
    labels_of,
    object_meta,
    pod_security,
    service,
)

GATEWAY_HTTP_PORT = 8000  # every Pagoda gateway's OpenAI HTTP port (wiring/k8s.py's too)
MODEL_SERVER = "model-server"  # the replicas' own gateways: the pool's pods
POOL_GROUP = "inference.networking.k8s.io"  # InferencePool v1
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # InferenceObjective v1alpha2
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
EPP_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT = 9002, 9003, 9090
EPP_CONFIG_FILE = "default-plugins.yaml"
EPP_UID = 65532  # the image's nonroot user (distroless)

# The scorers of the extension's default profile for vLLM-compatible servers: the queue, the
# KV cache's usage and the prefix cache (its scorer hashes prompts in blocks of the size
# vllm:cache_config_info reports), weighted as the extension's chart weights them.
EPP_CONFIG = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer"},
        {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
        {"type": "core-metrics-extractor"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
            ],
        }
    ],
}


class PoolOptions(HasNamespace):
    """What the pool takes of the renderer's options (wiring/k8s.py K8sOptions)."""

    inference_pool: str
    objectives: tuple[tuple[str, int], ...]
    image_pull_policy: str


def epp_name(pool: str) -> str:
    return f"{pool}-epp"


def pool_manifests(options: PoolOptions) -> list[dict[str, Any]]:
    """The InferencePool, its objectives and its endpoint picker."""
    return [inference_pool(options), *objectives(options), *endpoint_picker(options)]


def inference_pool(options: PoolOptions) -> dict[str, Any]:
    """The pool: every replica's own gateway (the model-server pods), HTTP on :8000."""
    name = options.inference_pool
    return {
        "apiVersion": f"{POOL_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": object_meta(options, name, labels_of("inference-pool")),
        "spec": {
            "selector": {"matchLabels": {NAME_LABEL: "pagoda", **_component(MODEL_SERVER)}},
            "targetPorts": [{"number": GATEWAY_HTTP_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "name": epp_name(name),
                "kind": "Service",
                "port": {"number": EPP_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def objectives(options: PoolOptions) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": f"{OBJECTIVE_GROUP}/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": object_meta(options, name, labels_of("inference-objective")),
            "spec": {"priority": priority, "poolRef": {"group": POOL_GROUP, "name": options.inference_pool}},
        }
        for name, priority in options.objectives
    ]


def endpoint_picker(options: PoolOptions) -> list[dict[str, Any]]:
    """The EPP: its configuration, identity and read access, Deployment and Service."""
    name = epp_name(options.inference_pool)
    labels = labels_of("endpoint-picker")
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(options, name, labels),
        "data": {EPP_CONFIG_FILE: yaml.safe_dump(EPP_CONFIG, sort_keys=False)},
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(options, name, labels)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(options, name, labels),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]},
            {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": ["get", "watch", "list"]},
            {"apiGroups": [OBJECTIVE_GROUP], "resources": ["inferenceobjectives"], "verbs": ["get", "watch", "list"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(options, name, labels),
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": options.namespace}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
    }
    return [
        config,
        account,
        role,
        binding,
        _epp_deployment(options, name, labels),
        service(
            options,
            name,
            labels,
            [("grpc-ext-proc", EPP_PORT), ("grpc-health", EPP_HEALTH_PORT), ("metrics", EPP_METRICS_PORT)],
        ),
    ]


def _epp_deployment(options: PoolOptions, name: str, labels: dict[str, str]) -> dict[str, Any]:
    health = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": "epp",
        "image": EPP_IMAGE,
        "imagePullPolicy": options.image_pull_policy,
        "args": [
            "--pool-name",
            options.inference_pool,
            "--pool-namespace",
            options.namespace,
            "--pool-group",
            POOL_GROUP,
            "--config-file",
            f"/config/{EPP_CONFIG_FILE}",
            "--zap-encoder",
            "json",
            "--tracing=false",
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_PORT},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT},
        ],
        "livenessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**health, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
    }
    pod = {
        "serviceAccountName": name,
        "securityContext": pod_security(EPP_UID),
        "terminationGracePeriodSeconds": 130,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": name}}],
    }
    # one active picker (its prefix-cache view is per process), replaced at once on an update
    return deployment(options, name, labels, pod, 1, {"type": "Recreate"})


def _component(component: str) -> dict[str, str]:
    return {k: v for k, v in labels_of(component).items() if k != NAME_LABEL}
