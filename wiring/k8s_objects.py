"""Kubernetes objects as the renderers write them (wiring/k8s.py, wiring/inference_pool.py):
Pagoda's labels and metadata, pod and container security, Deployments, Services and
PodDisruptionBudgets. Pure Python, no Kubernetes client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

UID = 10001  # the image's user (Dockerfile)
NAME_LABEL, COMPONENT_LABEL, REPLICA_LABEL, ROLE_LABEL = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/component",
    "pagoda.dev/replica",
    "pagoda.dev/role",  # prefill or decode, on a disaggregated replica's pods (issue 39)
)


class HasNamespace(Protocol):
    """What the objects take of the renderer's options (wiring/k8s.py K8sOptions)."""

    namespace: str


def labels_of(component: str, replica: str | None = None, role: str | None = None) -> dict[str, str]:
    labels = {NAME_LABEL: "pagoda", COMPONENT_LABEL: component}
    if replica is not None:
        labels[REPLICA_LABEL] = replica
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def object_meta(options: HasNamespace, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": options.namespace,
        "labels": {**labels, "app.kubernetes.io/managed-by": "pagoda-k8s-manifests"},
    }


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def pod_security(uid: int = UID) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def deployment(
    options: HasNamespace,
    name: str,
    labels: dict[str, str],
    pod: dict,
    replicas: int,
    strategy: dict,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    template_meta: dict[str, Any] = {"labels": dict(labels)}
    if annotations:
        template_meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(options, name, labels),
        "spec": {
            "replicas": replicas,
            "strategy": dict(strategy),
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": template_meta, "spec": pod},
        },
    }


def service(
    options: HasNamespace,
    name: str,
    labels: dict[str, str],
    ports: list[tuple[str, int]],
    *,
    headless: bool = False,
    service_type: str = "ClusterIP",
    not_ready: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": service_type}
    if headless:
        spec["clusterIP"] = "None"
    if not_ready:  # internal: the caller's own health logic decides (e.g. a broken KV service
        # must stay reachable for the scheduler's Reset), not the readiness probe
        spec["publishNotReadyAddresses"] = True
    spec["selector"] = dict(labels)
    spec["ports"] = [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports]
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(options, name, labels), "spec": spec}


def pdb(options: HasNamespace, name: str, selector: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(options, name, labels),
        "spec": {"maxUnavailable": 1, "selector": selector},
    }
