"""`pagoda k8s-manifests` (wiring/k8s.py), checked offline: no cluster runs where the tests do.

Every manifest is validated against Kubernetes 1.30's schemas in strict mode (unknown
fields fail; `kubernetes-validate`, installed by `make install`). Then the manifests must
agree with one another and with `pagoda` itself, as tests/unit/test_compose.py checks the
compose stack: every address names a Service that exists, with that port, reaching the
right pods; Service and PodDisruptionBudget selectors select pods; one KV layout per
replica; the probes on the ports the processes bind; every container's command is one
that `pagoda`'s own parser accepts, with the environment the pod gives it (the stage
workers' shell command is run, for each stage, with a stand-in `pagoda` that prints its
arguments).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
from contextlib import contextmanager
from typing import Any

import kubernetes_validate
import pytest
import yaml

from wiring import k8s, k8s_cli, k8s_objects, k8s_options
from wiring.cli import build_parser

KUBERNETES_VERSION = "1.30.0"
CONFIGS = {
    "one": k8s_options.K8sOptions(),
    "four": k8s_options.K8sOptions(
        replicas=4, engine={"max_num_seqs": 64, "max_model_len": 8192, "enable_prefix_caching": True}
    ),
    "four-pp2-tp2-gpus": k8s_options.K8sOptions(
        replicas=4,
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        gpus=True,
        gpu_memory_utilization=0.9,
        num_kv_blocks=4096,
        model_path="/models/Meta-Llama-3.1-8B-Instruct",
    ),
    "two-pp3": k8s_options.K8sOptions(replicas=2, pipeline_parallel_size=3, block_size=32, namespace="llm"),
    # P/D disaggregation (issue 39): prefill replica p0, decode replicas d0 and d1
    "pd-1p-2d-pp2": k8s_options.K8sOptions(prefill_replicas=1, decode_replicas=2, pipeline_parallel_size=2),
}
SECRET = "<from a Secret>"
GRPC_PORT_FLAG = {"kvcache": "--port", "scheduler": "--port", "worker": "--port", "gateway": "--grpc-port"}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def config(request) -> tuple[k8s_options.K8sOptions, list[dict[str, Any]]]:
    """The options and their manifests, as `kubectl` reads them back from the YAML."""
    options = CONFIGS[request.param]
    manifests = k8s.render(options)
    loaded = list(yaml.safe_load_all(k8s.to_yaml(manifests)))
    assert loaded == manifests  # the YAML says what render built: no lost types or values
    return options, loaded


@pytest.fixture(scope="module")
def fake_pagoda(tmp_path_factory) -> str:
    """A directory with a `pagoda` that prints its arguments, NUL-separated."""
    bin_dir = tmp_path_factory.mktemp("bin")
    script = bin_dir / "pagoda"
    script.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


# --- reading the manifests -----------------------------------------------------------------


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def workloads(manifests: list[dict]) -> list[dict]:
    return [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def main_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def component(workload: dict) -> str:
    return pod_labels(workload)[k8s_objects.COMPONENT_LABEL]


def pagoda_workloads(manifests: list[dict]) -> list[dict]:
    return [w for w in workloads(manifests) if component(w) != "redis"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (Service: a plain map; PDB: matchLabels and matchExpressions)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] in ("In", "NotIn"), expr
        inside = labels.get(expr["key"]) in expr["values"]
        if inside != (expr["operator"] == "In"):
            return False
    return True


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def container_env(manifests: list[dict], container: dict) -> dict[str, str]:
    """The environment a container starts with (envFrom first; env overrides)."""
    config_maps = by_kind(manifests, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else SECRET
    return env


def run_worker_command(container: dict, pod_name: str, bin_dir: str) -> list[str]:
    """What the stage pod `pod_name` runs: its container's command, with HOSTNAME set."""
    done = subprocess.run(
        container["command"],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOSTNAME": pod_name},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\0")[:-1]


def argv_of(manifests: list[dict], workload: dict, bin_dir: str) -> list[tuple[str, list[str]]]:
    """(pod name, pagoda argv) of each pod of a workload."""
    container = main_container(workload)
    if workload["kind"] == "StatefulSet":
        name = workload["metadata"]["name"]
        return [
            (f"{name}-{k}", run_worker_command(container, f"{name}-{k}", bin_dir))
            for k in range(workload["spec"]["replicas"])
        ]
    assert "command" not in container  # the image's entrypoint, `pagoda`, runs the args
    return [(workload["metadata"]["name"], container["args"])]


@contextmanager
def environment(env: dict[str, str]):
    """os.environ holding no PAGODA_* but `env` (the flags' defaults read it)."""
    saved = dict(os.environ)
    try:
        for name in [n for n in os.environ if n.startswith("PAGODA_")]:
            del os.environ[name]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    with environment(env):
        return build_parser().parse_args(argv)


def gateway_takes(option: str) -> bool:
    """Whether `pagoda gateway` has this flag (the P/D gateway is built beside the renderer)."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return option in sub.choices["gateway"]._option_string_actions


def reached(manifests: list[dict], address: str) -> list[tuple[dict, int | None]]:
    """The workloads (and the StatefulSet ordinal, if a pod is named) that HOST:PORT reaches
    inside the namespace; fails unless it names a Service with that port whose target pods
    listen there."""
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    services = by_kind(manifests, "Service")
    ordinal = None
    if "." in host:  # POD.SERVICE: a StatefulSet pod through its headless Service
        pod, service_name = host.split(".", 1)
        service = services[service_name]
        assert service["spec"].get("clusterIP") == "None", f"{address}: {service_name} is not headless"
        (sts,) = [s for s in by_kind(manifests, "StatefulSet").values() if s["spec"]["serviceName"] == service_name]
        prefix = sts["metadata"]["name"] + "-"
        assert pod.startswith(prefix) and pod[len(prefix) :].isdigit(), f"{address}: no pod {pod}"
        ordinal = int(pod[len(prefix) :])
        assert ordinal < sts["spec"]["replicas"], f"{address}: {sts['metadata']['name']} has no pod {ordinal}"
    else:
        assert host in services, f"{address}: no Service {host}"
        service = services[host]
    (svc_port,) = [p for p in service["spec"]["ports"] if p["port"] == port] or [None]
    assert svc_port is not None, f"{address}: Service {service['metadata']['name']} has no port {port}"
    targets = [w for w in workloads(manifests) if selects(service["spec"]["selector"], pod_labels(w))]
    assert targets, f"{address}: Service {service['metadata']['name']} selects no pods"
    for w in targets:
        ports = [p["containerPort"] for p in main_container(w)["ports"]]
        assert svc_port["targetPort"] in ports, f"{address}: {w['metadata']['name']} does not listen there"
    return [(w, ordinal) for w in targets]


def reaches_one(
    manifests: list[dict], address: str, comp: str, replica: str | None, ordinal: int | None = None
) -> None:
    ((workload, got_ordinal),) = reached(manifests, address)
    labels = pod_labels(workload)
    assert labels[k8s_objects.COMPONENT_LABEL] == comp, f"{address} reaches {labels}, not a {comp}"
    assert labels.get(k8s_objects.REPLICA_LABEL) == replica, f"{address} reaches {labels}, not replica {replica}"
    assert got_ordinal == ordinal, f"{address}: stage {got_ordinal}, expected {ordinal}"


# --- the schema ----------------------------------------------------------------------------


def test_every_manifest_validates_strictly(config):
    options, manifests = config
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_an_unknown_field():
    manifest = k8s.render(k8s_options.K8sOptions())[0]
    manifest["metadata"]["label"] = {"typo": "x"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_objects_are_named_labelled_and_namespaced(config):
    options, manifests = config
    keys = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(keys) == len(set(keys))
    for m in manifests:
        assert m["metadata"]["namespace"] == options.namespace
        assert m["metadata"]["labels"][k8s_objects.NAME_LABEL] == "pagoda"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m["metadata"]["name"])
    assert not by_kind(manifests, "Secret"), "secrets are the operator's, never rendered"
    for w in workloads(manifests):
        labels = pod_labels(w)
        assert (
            labels[k8s_objects.NAME_LABEL] == "pagoda" and labels[k8s_objects.COMPONENT_LABEL] in k8s_options.COMPONENTS
        )
        assert (k8s_objects.REPLICA_LABEL in labels) == (component(w) in ("kvcache", "scheduler", "worker"))
        role = options.role_of(labels[k8s_objects.REPLICA_LABEL]) if k8s_objects.REPLICA_LABEL in labels else None
        assert labels.get(k8s_objects.ROLE_LABEL) == role  # only a disaggregated replica's pods have one
        assert w["spec"]["selector"]["matchLabels"] == labels
        if w["kind"] == "StatefulSet":  # its pods' names must be DNS labels, with a revision hash to spare
            assert len(w["metadata"]["name"]) <= 52
    expected = {
        "gateway": 1,
        "redis": 1,
        "kvcache": len(options.replica_names),
        "scheduler": len(options.replica_names),
        "worker": len(options.replica_names),
    }
    assert {c: sum(component(w) == c for w in workloads(manifests)) for c in expected} == expected
    gateway = by_kind(manifests, "Deployment")[k8s_options.GATEWAY]
    assert gateway["spec"]["replicas"] == options.gateway_replicas
    for r in options.replica_names:
        assert (
            by_kind(manifests, "StatefulSet")[k8s_options.worker_name(r)]["spec"]["replicas"]
            == options.pipeline_parallel_size
        )
        for name in (k8s_options.kvcache_name(r), k8s_options.scheduler_name(r)):  # never two at once
            assert by_kind(manifests, "Deployment")[name]["spec"] == {
                **by_kind(manifests, "Deployment")[name]["spec"],
                "replicas": 1,
                "strategy": {"type": "Recreate"},
            }


# --- selectors -----------------------------------------------------------------------------


def test_every_service_selects_pods_that_listen_on_its_ports(config):
    options, manifests = config
    for service in by_kind(manifests, "Service").values():
        targets = [w for w in workloads(manifests) if selects(service["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {len(targets)} workloads"
        ports = {p["containerPort"] for p in main_container(targets[0])["ports"]}
        for p in service["spec"]["ports"]:
            assert p["targetPort"] == p["port"] and p["port"] in ports, (service["metadata"]["name"], p)
    for sts in by_kind(manifests, "StatefulSet").values():
        headless = by_kind(manifests, "Service")[sts["spec"]["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
        assert sts["spec"]["podManagementPolicy"] == "Parallel"  # no stage waits for another to be ready


def test_disruption_budgets_select_existing_pods(config):
    options, manifests = config
    budgets = by_kind(manifests, "PodDisruptionBudget")
    chosen = {
        name: {component(w) for w in workloads(manifests) if selects(pdb["spec"]["selector"], pod_labels(w))}
        for name, pdb in budgets.items()
    }
    assert chosen == {k8s_options.GATEWAY: {"gateway"}, k8s_options.BACKEND_PDB: {"kvcache", "scheduler", "worker"}}
    backend = [
        w for w in workloads(manifests) if selects(budgets[k8s_options.BACKEND_PDB]["spec"]["selector"], pod_labels(w))
    ]
    assert len(backend) == 3 * len(options.replica_names)  # every replica's pods: at most one disrupted
    assert all(pdb["spec"]["maxUnavailable"] == 1 for pdb in budgets.values())


# --- addresses -----------------------------------------------------------------------------


def test_every_address_names_a_service_with_that_port(config, fake_pagoda):
    options, manifests = config
    deployments, statefulsets = by_kind(manifests, "Deployment"), by_kind(manifests, "StatefulSet")
    n = options.pipeline_parallel_size
    for r in options.replica_names:
        ((_, argv),) = argv_of(manifests, deployments[k8s_options.scheduler_name(r)], fake_pagoda)
        reaches_one(manifests, flag(argv, "--kvcache"), "kvcache", r)
        stages = flag(argv, "--stages").split(",")
        assert len(stages) == n == int(flag(argv, "--pipeline-parallel-size"))
        for k, address in enumerate(stages):
            reaches_one(manifests, address, "worker", r, k)
        init = deployments[k8s_options.scheduler_name(r)]["spec"]["template"]["spec"]["initContainers"]
        waited = init[0]["command"][3:]  # python -c CODE ADDRESS...
        assert waited == [flag(argv, "--kvcache"), *stages]
        ((_, argv),) = argv_of(manifests, deployments[k8s_options.kvcache_name(r)], fake_pagoda)
        assert flag(argv, "--replica-id") == r
        reaches_one(manifests, flag(argv, "--redis-url").removeprefix("redis://").removesuffix("/0"), "redis", None)
        for k, (pod, argv) in enumerate(argv_of(manifests, statefulsets[k8s_options.worker_name(r)], fake_pagoda)):
            assert pod == f"{k8s_options.worker_name(r)}-{k}" and int(flag(argv, "--stage")) == k
            if k < n - 1:
                reaches_one(manifests, flag(argv, "--next"), "worker", r, k + 1)
            else:
                assert "--next" not in argv
            if n > 1 and k == n - 1:
                reaches_one(manifests, flag(argv, "--feedback"), "worker", r, 0)
            else:
                assert "--feedback" not in argv
    ((_, argv),) = argv_of(manifests, deployments[k8s_options.GATEWAY], fake_pagoda)
    pools = {"--scheduler": options.decode_names if options.disaggregated else options.replica_names}
    if options.disaggregated:
        pools["--prefill-scheduler"] = options.prefill_names
    else:
        assert "--prefill-scheduler" not in argv
    for pool_flag, names in pools.items():
        routes = [part.split("=", 1) for part in flag(argv, pool_flag).split(",")]
        assert [name for name, _ in routes] == names
        for name, address in routes:
            reaches_one(manifests, address, "scheduler", name)
    reaches_one(manifests, flag(argv, "--redis-url").removeprefix("redis://").removesuffix("/0"), "redis", None)


def test_the_worker_command_is_worker_args_for_every_stage(config, fake_pagoda):
    options, manifests = config
    for r in options.replica_names:
        sts = by_kind(manifests, "StatefulSet")[k8s_options.worker_name(r)]
        for k, (_, argv) in enumerate(argv_of(manifests, sts, fake_pagoda)):
            assert argv == k8s.worker_args(options, r, k)


def test_the_worker_command_refuses_a_hostname_without_an_ordinal(fake_pagoda):
    (sts,) = by_kind(k8s.render(k8s_options.K8sOptions()), "StatefulSet").values()
    done = subprocess.run(
        main_container(sts)["command"],
        env={"PATH": f"{fake_pagoda}:/usr/bin:/bin", "HOSTNAME": "pagoda-worker"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 1 and "cannot read the stage" in done.stderr and done.stdout == ""


# --- environment ---------------------------------------------------------------------------


def test_one_kv_layout_per_replica(config):
    options, manifests = config
    layout = {"PAGODA_NUM_KV_BLOCKS": str(options.num_kv_blocks), "PAGODA_BLOCK_SIZE": str(options.block_size)}
    for r in options.replica_names:
        for w in pagoda_workloads(manifests):
            if pod_labels(w).get(k8s_objects.REPLICA_LABEL) == r:
                env = container_env(manifests, main_container(w))
                assert {name: env.get(name) for name in layout} == layout, w["metadata"]["name"]


def test_the_stage_definitions_carry_tensor_parallel_size_and_memory_utilization(config):
    options, manifests = config
    f = options.gpu_memory_utilization
    for sts in by_kind(manifests, "StatefulSet").values():
        container = main_container(sts)
        literal = {v["name"]: v.get("value") for v in container["env"]}  # in the StatefulSet itself
        assert literal["PAGODA_TENSOR_PARALLEL_SIZE"] == str(options.tensor_parallel_size)
        assert literal["PAGODA_GPU_MEMORY_UTILIZATION"] == ("" if f is None else str(f))
        assert literal["PAGODA_DEVICE"] == ("cuda" if options.gpus else "cpu")
        limits = container["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == (options.tensor_parallel_size if options.gpus else None)
        volumes = {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert ("shm" in volumes) == (options.tensor_parallel_size > 1)
    for w in workloads(manifests):
        if w["kind"] != "StatefulSet":
            assert "nvidia.com/gpu" not in yaml.safe_dump(w), w["metadata"]["name"]


def test_pods_restart_when_the_engine_settings_change():
    def hashes(options: k8s_options.K8sOptions) -> set[str]:
        return {
            w["spec"]["template"]["metadata"]["annotations"][k8s_options.ENGINE_CONFIG_HASH]
            for w in pagoda_workloads(k8s.render(options))
        }

    (before,) = hashes(k8s_options.K8sOptions(replicas=2))
    assert hashes(k8s_options.K8sOptions(replicas=3)) == {before}
    assert hashes(k8s_options.K8sOptions(replicas=2, engine={"max_num_seqs": 64})) != {before}
    assert hashes(k8s_options.K8sOptions(replicas=2, num_kv_blocks=2048)) != {before}


def test_every_pagoda_container_takes_the_internal_token_from_a_secret(config):
    options, manifests = config
    for w in pagoda_workloads(manifests):
        (token,) = [v for v in main_container(w)["env"] if v["name"] == "PAGODA_INTERNAL_TOKEN"]
        assert token == {
            "name": "PAGODA_INTERNAL_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": options.internal_token_secret, "key": options.internal_token_key}},
        }


def test_the_models_and_the_api_keys_are_mounted_where_the_flags_point(config, fake_pagoda):
    options, manifests = config
    for w in pagoda_workloads(manifests):
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in main_container(w)["volumeMounts"]}
        for _, argv in argv_of(manifests, w, fake_pagoda):
            model = flag(argv, "--model")
            if component(w) == "kvcache":
                assert model is None and k8s_options.MODELS_MOUNT not in mounts
                continue
            assert model == options.model_path
            mount = mounts[k8s_options.MODELS_MOUNT]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["persistentVolumeClaim"] == {
                "claimName": options.models_claim,
                "readOnly": True,
            }
    gateway = by_kind(manifests, "Deployment")[k8s_options.GATEWAY]
    keys_file = flag(main_container(gateway)["args"], "--api-keys-file")
    mount = {m["mountPath"]: m for m in main_container(gateway)["volumeMounts"]}[os.path.dirname(keys_file)]
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == options.api_keys_secret
    assert volume["secret"]["items"] == [{"key": options.api_keys_key, "path": os.path.basename(keys_file)}]


# --- probes and security -------------------------------------------------------------------


def test_probes_are_grpc_health_on_the_service_ports(config, fake_pagoda):
    options, manifests = config
    for w in pagoda_workloads(manifests):
        container, comp = main_container(w), component(w)
        port = int(flag(argv_of(manifests, w, fake_pagoda)[0][1], GRPC_PORT_FLAG[comp]))
        assert {"name": "grpc", "containerPort": port} in container["ports"]
        assert container["readinessProbe"]["grpc"] == {"port": port}
        live = container["livenessProbe"]
        if comp in ("kvcache", "worker"):  # their health is their own
            assert live["grpc"] == {"port": port}
        elif comp == "scheduler":  # its health is the pipeline's: a stage restarting must not restart it
            assert live["tcpSocket"] == {"port": port}
        else:  # the gateway's follows the replicas'
            assert live["httpGet"] == {"path": "/version", "port": int(flag(container["args"], "--port"))}
        if comp == "worker":  # the model loads first
            startup = container["startupProbe"]
            assert startup["grpc"] == {"port": port}
            assert startup["periodSeconds"] * startup["failureThreshold"] >= options.worker_startup_s


def test_pods_run_unprivileged(config):
    options, manifests = config
    for w in workloads(manifests):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == (
            k8s_objects.UID if component(w) != "redis" else k8s_options.REDIS_UID
        )
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False  # no {SERVICE}_PORT variables to read as PAGODA_* flags
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert container["resources"]["limits"]["memory"]
        if component(w) != "redis":
            writable = {m["mountPath"] for m in main_container(w)["volumeMounts"]}
            assert {"/tmp", "/home/pagoda"} <= writable  # the kernel cache, Hugging Face's


# --- the pagoda command lines --------------------------------------------------------------


def test_the_scheduler_and_workers_parse_with_their_pods_environment(config, fake_pagoda):
    options, manifests = config
    f = options.gpu_memory_utilization
    for w in pagoda_workloads(manifests):
        comp = component(w)
        if comp not in ("scheduler", "worker"):
            continue
        env = container_env(manifests, main_container(w))
        for _, argv in argv_of(manifests, w, fake_pagoda):
            args = parse(argv, env)
            assert args.command == comp and args.host == "0.0.0.0"
            assert (args.num_kv_blocks, args.block_size) == (options.num_kv_blocks, options.block_size)
            for name, value in options.engine.items():
                if hasattr(args, name):  # each reads the settings it has a flag for
                    assert getattr(args, name) == value, name
            if comp == "worker":
                assert args.tensor_parallel_size == options.tensor_parallel_size
                assert args.gpu_memory_utilization == f
                assert args.num_stages == options.pipeline_parallel_size
                assert args.device == ("cuda" if options.gpus else "cpu")
                assert args.num_threads == options.worker_threads
                decode = options.role_of(pod_labels(w)[k8s_objects.REPLICA_LABEL]) == k8s_options.DECODE
                assert args.kv_import_blocks == (options.import_blocks if decode else 0)
            else:
                assert args.pipeline_parallel_size == options.pipeline_parallel_size


def test_the_kv_service_parses(config, fake_pagoda):
    """Needs `pagoda kvcache --replica-id --redis-url` (issue 13)."""
    options, manifests = config
    for r in options.replica_names:
        w = by_kind(manifests, "Deployment")[k8s_options.kvcache_name(r)]
        args = parse(main_container(w)["args"], container_env(manifests, main_container(w)))
        assert (args.num_blocks, args.block_size) == (options.num_kv_blocks, options.block_size)
        decode = options.role_of(r) == k8s_options.DECODE
        assert args.replica_id == r and args.redis_url == k8s_options.redis_url()
        assert args.kv_import_blocks == (options.import_blocks if decode else 0)


def test_the_gateway_parses_in_router_mode(config):
    """Needs `pagoda gateway --routing` and `--scheduler NAME=ADDR,...` (issue 13)."""
    options, manifests = config
    gateway = main_container(by_kind(manifests, "Deployment")[k8s_options.GATEWAY])
    if options.disaggregated and not gateway_takes("--prefill-scheduler"):
        pytest.skip("`pagoda gateway --prefill-scheduler` (issue 39) is not in this tree yet")
    args = parse(gateway["args"], container_env(manifests, gateway))
    assert args.routing == options.routing and args.redis_url == k8s_options.redis_url()
    assert args.max_model_len == options.engine.get("max_model_len")


def test_every_engine_setting_is_read_by_a_service():
    """A `--set` name no service reads (a typo) would be silently ignored: each key of the
    ConfigMap must change some subcommand's parsed arguments when its value does."""
    minimal = {
        "kvcache": ["kvcache"],
        "worker": ["worker", "--model", "m"],
        "scheduler": ["scheduler", "--model", "m", "--kvcache", "k:1", "--stages", "s:1"],
        "gateway": ["gateway", "--model", "m", "--scheduler", "g:1"],
    }
    options = CONFIGS["four"]
    (config_map,) = by_kind(k8s.render(options), "ConfigMap").values()

    def settings(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        return {k: v for k, v in vars(parse(argv, env)).items() if k not in ("func", "parser")}

    for name, value in config_map["data"].items():
        other = {"true": "false", "false": "true"}.get(value) or (
            str(int(value) + 1) if value.isdigit() else value + "x"
        )  # another value: does it show?
        changed = [c for c, argv in minimal.items() if settings(argv, {name: value}) != settings(argv, {name: other})]
        assert changed, f"{name}={value}: read by no service"


def test_the_renderer_is_pure_python():
    code = (
        "import sys, wiring.k8s, wiring.k8s_cli; bad = [m for m in ('torch', 'grpc', 'gateway', 'scheduler_svc') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_routing_policies_are_the_gateways():
    from gateway.routing import POLICIES

    assert k8s_cli.ROUTING_POLICIES == POLICIES


# --- P/D disaggregation (issue 39) ---------------------------------------------------------

PD = CONFIGS["pd-1p-2d-pp2"]


def test_disaggregated_replicas_are_a_prefill_and_a_decode_pool_of_stacks():
    manifests = k8s.render(PD)
    assert PD.replica_names == ["p0", "d0", "d1"]
    kinds = {
        k8s_options.kvcache_name: "Deployment",
        k8s_options.scheduler_name: "Deployment",
        k8s_options.worker_name: "StatefulSet",
    }
    for r, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        for name_of, kind in kinds.items():
            w = by_kind(manifests, kind)[name_of(r)]
            labels = pod_labels(w)
            assert (labels[k8s_objects.REPLICA_LABEL], labels[k8s_objects.ROLE_LABEL]) == (r, role)
            assert by_kind(manifests, "Service")[name_of(r)]["spec"]["selector"] == labels
        assert by_kind(manifests, "StatefulSet")[k8s_options.worker_name(r)]["spec"]["replicas"] == 2
    assert not [m["metadata"]["name"] for m in manifests if "-r0-" in m["metadata"]["name"]]


def test_the_gateway_sends_prompts_to_the_prefill_pool_and_generation_to_the_decode_pool():
    from gateway.replicas import parse_targets

    args = k8s.gateway_args(PD)
    assert main_container(by_kind(k8s.render(PD), "Deployment")[k8s_options.GATEWAY])["args"] == args
    assert parse_targets(flag(args, "--scheduler")) == [
        ("d0", "pagoda-d0-scheduler:50052"),
        ("d1", "pagoda-d1-scheduler:50052"),
    ]
    assert parse_targets(flag(args, "--prefill-scheduler")) == [("p0", "pagoda-p0-scheduler:50052")]
    assert flag(args, "--routing") == "prefix" and flag(args, "--redis-url") == k8s_options.redis_url()
    assert "--prefill-scheduler" not in k8s.gateway_args(k8s_options.K8sOptions(replicas=3))


@pytest.mark.parametrize(("blocks", "expected"), [(None, "512"), (2048, "2048")])
def test_decode_kv_services_and_stages_take_kv_import_blocks(blocks, expected, fake_pagoda):
    options = k8s_options.K8sOptions(
        prefill_replicas=1, decode_replicas=2, pipeline_parallel_size=2, kv_import_blocks=blocks
    )
    manifests = k8s.render(options)
    deployments, statefulsets = by_kind(manifests, "Deployment"), by_kind(manifests, "StatefulSet")
    for r in options.replica_names:
        want = expected if r.startswith("d") else None  # a prefill replica needs nothing new
        ((_, kv),) = argv_of(manifests, deployments[k8s_options.kvcache_name(r)], fake_pagoda)
        assert flag(kv, "--kv-import-blocks") == want
        assert flag(kv, "--redis-url") == k8s_options.redis_url()  # each pool routed from its own entries
        for _, argv in argv_of(manifests, statefulsets[k8s_options.worker_name(r)], fake_pagoda):
            assert flag(argv, "--kv-import-blocks") == want
        ((_, scheduler),) = argv_of(manifests, deployments[k8s_options.scheduler_name(r)], fake_pagoda)
        assert "--kv-import-blocks" not in scheduler
    (config_map,) = by_kind(manifests, "ConfigMap").values()
    assert "PAGODA_KV_IMPORT_BLOCKS" not in config_map["data"]  # the decode pods' own, never shared


def test_decode_stages_reach_the_prefill_stages_they_pull_from(fake_pagoda):
    """A prefilled request carries its prefill replica's stages (KVTransfer.stage_addresses,
    that scheduler's --stages); decode stage k pulls from the k-th (StageWorker.ExportBlocks on
    the worker port): each must name prefill stage k, through its headless Service."""
    manifests = k8s.render(PD)
    deployments, statefulsets = by_kind(manifests, "Deployment"), by_kind(manifests, "StatefulSet")
    for p in PD.prefill_names:
        ((_, argv),) = argv_of(manifests, deployments[k8s_options.scheduler_name(p)], fake_pagoda)
        stages = flag(argv, "--stages").split(",")
        for k, address in enumerate(stages):
            assert address.endswith(f":{k8s_options.WORKER_PORT}")
            ((w, ordinal),) = reached(manifests, address)
            assert (pod_labels(w)[k8s_objects.ROLE_LABEL], pod_labels(w)[k8s_objects.REPLICA_LABEL]) == ("prefill", p)
            assert ordinal == k
        for d in PD.decode_names:  # the same split: decode stage k exists for every prefill stage k
            pods = argv_of(manifests, statefulsets[k8s_options.worker_name(d)], fake_pagoda)
            assert [int(flag(a, "--stage")) for _, a in pods] == list(range(len(stages)))
    # No NetworkPolicy is rendered, so nothing stands between the pools; a renderer that adds
    # policies must let decode workers reach prefill workers on the worker port (and check it here).
    assert not by_kind(manifests, "NetworkPolicy")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill_replicas": 2}, "give both (at least one of each) or neither"),
        ({"decode_replicas": 2}, "give both"),
        ({"prefill_replicas": -1, "decode_replicas": 1}, "prefill_replicas: must be a non-negative integer"),
        ({"prefill_replicas": 101, "decode_replicas": 1}, "at most 100 each"),
        ({"prefill_replicas": 1, "decode_replicas": 1, "replicas": 2}, "replicas: not with prefill_replicas"),
        ({"prefill_replicas": 1, "decode_replicas": 1, "tensor_parallel_size": 2}, "tensor_parallel_size: prefill/"),
        ({"prefill_replicas": 1, "decode_replicas": 1, "inference_pool": "pool"}, "inference_pool: not with"),
        (
            {"prefill_replicas": 1, "decode_replicas": 1, "engine": {"enable_prefix_caching": "false"}},
            "enable_prefix_caching: prefill/decode replicas need it",
        ),
        (
            {"prefill_replicas": 1, "decode_replicas": 1, "engine": {"enable_prefix_caching": "maybe"}},
            "engine setting 'enable_prefix_caching': expected one of",
        ),
        (
            {"prefill_replicas": 1, "decode_replicas": 1, "engine": {"kv_groups": "0,512"}},
            "kv_groups: prefill/decode replicas need one KV group",
        ),
        ({"prefill_replicas": 1, "decode_replicas": 1, "kv_import_blocks": 0}, "kv_import_blocks: must be a positive"),
        ({"kv_import_blocks": 64}, "kv_import_blocks: only for decode replicas"),
        ({"engine": {"kv_import_blocks": 64}}, "set by the manifests themselves"),
        ({"engine": {"prefill_scheduler": "p0=x:1"}}, "set by the manifests themselves"),
    ],
)
def test_bad_disaggregation_options_are_refused(fields, message):
    with pytest.raises(ValueError) as caught:
        k8s_options.K8sOptions(**fields)
    assert message in str(caught.value)


def test_run_renders_and_refuses_prefill_and_decode_replicas(capsys):
    argv = ["--prefill-replicas", "1", "--decode-replicas", "2", "--pipeline-parallel-size", "2"]
    assert k8s_cli.run(_cli([*argv, "--kv-import-blocks", "1024"])) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Pagoda on Kubernetes (pagoda k8s-manifests; docs/deploy.md): 1 prefill + 2 decode")
    options = k8s_options.K8sOptions(
        prefill_replicas=1, decode_replicas=2, pipeline_parallel_size=2, kv_import_blocks=1024
    )
    assert list(yaml.safe_load_all(out)) == k8s.render(options)
    for extra, message in [
        (["--replicas", "1"], "error: --replicas: not with --prefill-replicas and --decode-replicas"),
        (["--tensor-parallel-size", "2"], "error: tensor_parallel_size: prefill/decode replicas need 1"),
        (["--inference-pool", "pool"], "error: inference_pool: not with prefill/decode replicas"),
    ]:
        assert k8s_cli.run(_cli([*argv, *extra])) == 2
        assert message in capsys.readouterr().err
    assert k8s_cli.run(_cli(["--decode-replicas", "2"])) == 2
    assert "give both" in capsys.readouterr().err


# --- options and the command line ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replicas": 0}, "replicas: must be a positive integer"),
        ({"pipeline_parallel_size": 9}, "pipeline_parallel_size: must be 1..8"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization: must be in (0, 1]"),
        ({"model_path": "/data/model"}, "model_path: must be a normalized path under /models/"),
        ({"model_path": "/models/../etc"}, "model_path"),
        ({"namespace": "Pagoda"}, "namespace: must be a DNS label"),
        ({"routing": "random"}, "routing: must be one of prefix, least-loaded, round-robin"),
        ({"engine": {"num_kv_blocks": 10}}, "set by the manifests themselves"),
        ({"engine": {"Max-Num-Seqs": 1}}, "expected a snake_case name"),
        ({"requests": {"router": k8s_options.Resources("1", "1Gi")}}, "unknown component(s) router"),
        ({"image": "pagoda local"}, "image: must be an image reference"),
    ],
)
def test_bad_options_are_refused_with_the_field_named(fields, message):
    with pytest.raises(ValueError) as caught:
        k8s_options.K8sOptions(**fields)
    assert message in str(caught.value)


def test_resources_refuse_bad_quantities():
    with pytest.raises(ValueError, match="cpu: expected a quantity"):
        k8s_options.Resources("four", "1Gi")
    with pytest.raises(ValueError, match="memory: expected a quantity"):
        k8s_options.Resources("4", "16GB")


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagoda k8s-manifests")
    k8s_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_writes_the_manifests(tmp_path, capsys):
    argv = [
        "--replicas",
        "4",
        "--pipeline-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        "--gpus",
        "--gpu-memory-utilization",
        "0.9",
        "--set",
        "max-num-seqs=64",
        "--requests",
        "worker=8,64Gi",
        "--namespace",
        "llm",
    ]
    expected = k8s.render(
        k8s_options.K8sOptions(
            replicas=4,
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            gpus=True,
            gpu_memory_utilization=0.9,
            engine={"max_num_seqs": "64"},
            requests={"worker": k8s_options.Resources("8", "64Gi")},
            namespace="llm",
        )
    )
    assert k8s_cli.run(_cli(argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Pagoda on Kubernetes")
    assert list(yaml.safe_load_all(out)) == expected
    assert k8s_cli.run(_cli([*argv, "--out", str(tmp_path / "pagoda.yaml")])) == 0
    assert list(yaml.safe_load_all((tmp_path / "pagoda.yaml").read_text())) == expected


def test_run_refuses_bad_options(capsys):
    assert k8s_cli.run(_cli(["--set", "port=1"])) == 2
    assert "error: engine setting 'port'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli(["--set", "max_num_seqs"])


@pytest.mark.parametrize(
    "name,argv",
    [
        ("pagoda-1-replica.yaml", ["--replicas", "1"]),
        (
            "pagoda-pd-1p-2d-pp2.yaml",
            ["--prefill-replicas", "1", "--decode-replicas", "2", "--pipeline-parallel-size", "2"],
        ),
        (
            "pagoda-4-replicas-pp2-tp2-gpu.yaml",
            [
                "--replicas",
                "4",
                "--pipeline-parallel-size",
                "2",
                "--tensor-parallel-size",
                "2",
                "--gpus",
                "--gpu-memory-utilization",
                "0.9",
            ],
        ),
    ],
)
def test_the_documented_examples_render_and_validate(tmp_path, name, argv):
    """docs/deploy.md's three examples, rendered on demand (never committed) by the command the
    page gives: each file parses and every object validates strictly."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser()
    k8s_cli.add_arguments(parser)
    out = tmp_path / name
    assert k8s_cli.run(parser.parse_args([*argv, "--out", str(out)])) == 0
    manifests = [m for m in yaml.safe_load_all(out.read_text()) if m]
    assert by_kind(manifests, "Service") and workloads(manifests)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
