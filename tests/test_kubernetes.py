"""The Helm chart (deploy/helm/tokenrelay), rendered offline by Helm's own engine and checked by reading.

`make helm-render` builds deploy/helm/render (Helm's chart loader, values and template engine) into
.tools/bin/helm-render; `make test` does it first, and the fixture here runs make too (a no-op when it
is built). Every rendered object is validated: Kubernetes' own kinds against the API schemas that
kubernetes-validate ships (strict: an unknown field is an error), the operators' kinds (KEDA, Prometheus
operator, Strimzi) against their CRDs' schemas vendored in deploy/helm/crd-schemas/. The rest checks
that the chart and the code agree: env names are flags, KEDA watches the topics and consumer group
the workers really use, probes hit the ports the processes listen on. Every example values file beside the
chart (deploy/helm/*.yaml) is rendered, and each container's process is started from its rendered environment as
far as it goes without a cluster (tests/test_deploy_files.py's `started`). Every pod must pass Pod Security
"restricted" as its admission controller checks pods, and run as the image's own user.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bus.topics import request_topics, worker_group
from tests.processes import REPO
from tests.test_deploy_files import _dockerfile, _flags_of, started
from tokenrelay.settings import Settings

CHART = REPO / "deploy" / "helm" / "tokenrelay"
TWO_MODELS = REPO / "deploy" / "helm" / "two-models.yaml"
LLAMA_70B = REPO / "deploy" / "helm" / "llama-70b.yaml"
EXAMPLES = sorted((REPO / "deploy" / "helm").glob("*.yaml"))  # the example values files, each rendered
CRD_SCHEMAS = REPO / "deploy" / "helm" / "crd-schemas"
RENDER = REPO / ".tools" / "bin" / "helm-render"
KUBERNETES_VERSION = "1.33"  # the oldest release the chart is checked against (kubernetes-validate has 1.x up to 1.37)
NAMESPACE = "inference"

# Variants beyond the values files: Strimzi's older API, everything optional off, a hub-id model.
STRIMZI_V1BETA2 = {"kafka": {"strimzi": {"apiVersion": "kafka.strimzi.io/v1beta2", "version": "4.1.1"}}}
MINIMAL = {
    "kafka": {"bootstrap": "kafka.example:9092", "strimzi": {"enabled": False}},
    "topicPrefix": "prod",
    "gateway": {"autoscaling": {"enabled": False}, "pdb": {"enabled": False}, "preStopSleepSeconds": 0},
    # Workers on CPUs: no GPU asked for, nor tolerated.
    "worker": {
        "pdb": {"enabled": False},
        "resources": {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
        "tolerations": [],
    },
    "keda": {"enabled": False},
    "models": [
        {"name": "qwen", "hubId": "Qwen/Qwen2.5-0.5B-Instruct", "replicas": 3},
        {"name": "bundled"},
    ],
}


@pytest.fixture(scope="session")
def render(tmp_path_factory):
    """render(values files or dicts...) -> the rendered objects, as `helm template` would print them."""
    subprocess.run(["make", "--no-print-directory", "-s", "helm-render"], cwd=REPO, check=True, timeout=900)
    folder = tmp_path_factory.mktemp("values")

    def _render(*values: Path | dict) -> list[dict]:
        args = []
        for i, value in enumerate(values):
            if isinstance(value, dict):
                path = folder / f"values-{len(list(folder.iterdir()))}-{i}.yaml"
                path.write_text(yaml.safe_dump(value))
                value = path
            args += ["-f", str(value)]
        out = subprocess.run(
            [str(RENDER), "--namespace", NAMESPACE, *args, str(CHART)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]

    return _render


VARIANTS = {
    "defaults": (),
    **{example.stem: (example,) for example in EXAMPLES},
    "strimzi-v1beta2": (STRIMZI_V1BETA2,),
    "minimal": (MINIMAL,),
}


@pytest.fixture(scope="session", params=list(VARIANTS))
def rendered(request, render) -> list[dict]:
    return render(*VARIANTS[request.param])


def _strict(schema):
    """A CRD schema as the API server applies it with field validation on (kubectl's default): a field
    that the schema does not name is an error, unless the schema keeps unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: (v if k == "enum" else _strict(v)) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    return schema


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Validator | None:
    group, _, version = api_version.rpartition("/")
    path = CRD_SCHEMAS / f"{group}_{kind.lower()}_{version}.json"
    if not group or not path.is_file():
        return None
    schema = _strict(json.loads(path.read_text()))
    # metadata is Kubernetes' ObjectMeta, which CRD schemas leave open; the API server checks it.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def _validate(doc: dict) -> None:
    validator = _crd_validator(doc["apiVersion"], doc["kind"])
    if validator is not None:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{doc['kind']} {list(e.absolute_path)}: {e.message}" for e in errors)
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} {list(e.absolute_path)}: {e.message}") from e
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"no schema, built-in or vendored, for {doc['apiVersion']} {doc['kind']}") from e


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _settings(deployment: dict) -> Settings:
    """The settings of the deployment's process, started from its rendered environment as far as it goes here (a
    value from a field, the pod's name, as pod-0; its model looked for on the volumes it mounts)."""
    container = _container(deployment)
    env = {name: "pod-0" if value is None else value for name, value in _env(container).items()}
    return started(container["command"][1], env, [mount["mountPath"] for mount in container.get("volumeMounts", [])])


def test_every_rendered_object_matches_its_schema(rendered):
    assert rendered
    for doc in rendered:
        _validate(doc)


def test_the_validation_catches_a_broken_object(render):
    docs = render()
    scaled = copy.deepcopy(next(d for d in docs if d["kind"] == "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 10  # KEDA's metadata holds strings
    with pytest.raises(AssertionError, match="lagThreshold"):
        _validate(scaled)
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = "10"
    scaled["spec"]["minReplicas"] = 1  # KEDA calls it minReplicaCount
    with pytest.raises(AssertionError, match="minReplicas"):
        _validate(scaled)
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    _container(deployment)["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(AssertionError, match="paht"):
        _validate(deployment)


def test_defaults_and_two_models_render_what_is_described(render):
    kinds = sorted(d["kind"] for d in render())
    assert kinds == sorted(
        ["Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
        + ["Deployment", "PodDisruptionBudget", "ScaledObject"]
        + ["Kafka", "KafkaNodePool"]
    )
    docs = render(TWO_MODELS)
    models = yaml.safe_load(TWO_MODELS.read_text())["models"]
    assert len(_by_kind(docs, "ScaledObject")) == len(models) == 2
    assert len(_by_kind(docs, "PodDisruptionBudget")) == 1 + len(models)
    assert len(_by_kind(docs, "ServiceMonitor")) == 2
    assert not _by_kind(docs, "Kafka")
    assert len(_by_kind(docs, "Deployment")) == 1 + len(models)


def test_every_setting_is_a_flag_of_the_command_the_container_runs(rendered):
    for deployment in _by_kind(rendered, "Deployment").values():
        container = _container(deployment)
        command = container["command"]
        assert command[0] == "tokenrelay"
        flags = _flags_of(command[1])
        env = _env(container)
        for name in env:
            if name.startswith("TOKENRELAY_"):
                flag = "--" + name.removeprefix("TOKENRELAY_").lower().replace("_", "-")
                assert flag in flags, f"{deployment['metadata']['name']}: {name} names no flag of `{' '.join(command)}`"
        _settings(deployment)  # every value is one its flag takes, and the process starts with them


def test_keda_watches_the_topics_and_group_of_the_workers_it_scales(rendered):
    deployments = _by_kind(rendered, "Deployment")
    kafka = _by_kind(rendered, "Kafka")
    scaled_objects = _by_kind(rendered, "ScaledObject")
    workers = [d for d in deployments.values() if _container(d)["command"] == ["tokenrelay", "worker"]]
    assert workers
    for scaled in scaled_objects.values():
        target = deployments[scaled["spec"]["scaleTargetRef"]["name"]]
        settings = _settings(target)
        model, prefix = settings.model.served_names[0], settings.worker.topic_prefix
        triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "kafka"]
        assert [t["metadata"]["topic"] for t in triggers] == request_topics(prefix, model)
        for trigger in triggers:
            assert trigger["metadata"]["consumerGroup"] == worker_group(prefix, model)
            bootstrap = trigger["metadata"]["bootstrapServers"]
            if kafka:  # KEDA's operator runs in its own namespace: the name must reach across
                (name,) = kafka
                assert settings.bus.bootstrap_servers == f"{name}-kafka-bootstrap:9092"
                assert bootstrap == f"{name}-kafka-bootstrap.{NAMESPACE}.svc:9092"
            else:
                assert bootstrap == settings.bus.bootstrap_servers
        assert "replicas" not in target["spec"]  # KEDA owns the count
    if scaled_objects:
        assert {d["metadata"]["name"] for d in workers} == set(scaled_objects)


def test_each_model_runs_what_its_entry_names(render):
    docs = render(TWO_MODELS)
    llama, qwen = (_by_kind(docs, "Deployment")[f"tokenrelay-worker-{name}"] for name in ("llama-8b", "qwen-05b"))
    settings = _settings(llama)
    assert settings.model.served_names == ("llama-3.1-8b", "llama3")
    assert settings.model.path == "/models/meta-llama-3.1-8b-instruct" and settings.model.dtype == "bfloat16"
    assert settings.engine.max_batch_size == 256 and settings.engine.gpu_memory_fraction == 0.9
    mount = next(m for m in _container(llama)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    volume = next(v for v in llama["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"]["claimName"] == "model-weights"
    settings = _settings(qwen)
    assert settings.model.path == settings.model.served_names[0] == "Qwen/Qwen2.5-0.5B-Instruct"
    group = worker_group(settings.worker.topic_prefix, settings.model.served_names[0])
    assert group == "tokenrelay.workers.Qwen_Qwen2.5-0.5B-Instruct"
    assert _env(_container(qwen))["HF_HOME"] == "/models/huggingface"  # the claim caches downloads
    assert "HF_TOKEN" in _env(_container(qwen))
    assert _container(qwen)["resources"]["requests"] == {"nvidia.com/gpu": 1, "cpu": "2", "memory": "8Gi"}
    for deployment in (llama, qwen):
        assert _container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1
    gateway = _settings(_by_kind(docs, "Deployment")["tokenrelay-gateway"]).gateway
    assert gateway.max_in_flight == 8192 and gateway.default_model == "llama-3.1-8b"


def test_without_autoscaling_the_replicas_are_the_values(render):
    docs = render(MINIMAL)
    deployments = _by_kind(docs, "Deployment")
    assert deployments["tokenrelay-gateway"]["spec"]["replicas"] == 2
    assert deployments["tokenrelay-worker-qwen"]["spec"]["replicas"] == 3
    assert deployments["tokenrelay-worker-bundled"]["spec"]["replicas"] == 1
    assert not {"HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget"} & {d["kind"] for d in docs}
    # no --model: the image's bundled model, under its own name
    assert "TOKENRELAY_MODEL" not in _env(_container(deployments["tokenrelay-worker-bundled"]))


def test_probes_reach_the_ports_the_processes_listen_on(rendered):
    for deployment in _by_kind(rendered, "Deployment").values():
        container = _container(deployment)
        settings = _settings(deployment)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if settings.command == "gateway":
            assert settings.server.host == "0.0.0.0" and ports["http"] == settings.server.port
            assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        else:
            host, _, port = settings.metrics_address.rpartition(":")
            assert host == "0.0.0.0" and ports["metrics"] == int(port)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_workers_are_restarted_when_unanswering_once_started_and_gateways_when_their_loop_stops(render):
    for values in ((), (TWO_MODELS,)):
        for name, deployment in _by_kind(render(*values), "Deployment").items():
            container = _container(deployment)
            if name == "tokenrelay-gateway":
                assert "startupProbe" not in container  # it listens within seconds
                assert container["livenessProbe"] == {
                    "httpGet": {"path": "/v2/health/live", "port": "http"},
                    "periodSeconds": 10,
                    "timeoutSeconds": 1,
                    "failureThreshold": 3,
                }
                continue
            # Kubernetes runs no liveness probe until the startup probe has passed: a model loads for its 15 minutes.
            assert container["startupProbe"] == {
                "httpGet": {"path": "/metrics", "port": "metrics"},
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 90,
            }
            assert container["livenessProbe"] == {
                "httpGet": {"path": "/metrics", "port": "metrics"},
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 6,
            }
    probes = {"livenessProbe": {"periodSeconds": 30, "failureThreshold": 4}}  # over the defaults, key by key
    for deployment in _by_kind(render({"worker": probes, "gateway": probes}), "Deployment").values():
        liveness = _container(deployment)["livenessProbe"]
        assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (30, 4)


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(quantity: str | int) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity)).groups()
    return int(number) * _QUANTITY.get(unit, 1)


def test_every_container_requests_memory_and_no_more_is_allowed_a_worker_than_it_asked_for(rendered):
    """Requests make the pods Burstable rather than BestEffort, the first evicted; a limit below its request
    would be refused by the API server (its schema does not say so)."""
    for name, deployment in _by_kind(rendered, "Deployment").items():
        resources = _container(deployment)["resources"]
        requested, limit = _bytes(resources["requests"]["memory"]), _bytes(resources["limits"]["memory"])
        assert 0 < requested <= limit, name
        assert "cpu" not in resources["limits"], name  # throttled, a worker would stall between GPU steps


def test_worker_memory_is_the_defaults_unless_a_model_has_its_own(render):
    defaults = {
        "requests": {"nvidia.com/gpu": 1, "cpu": "2", "memory": "16Gi"},
        "limits": {"nvidia.com/gpu": 1, "memory": "16Gi"},
    }
    (worker,) = (d for name, d in _by_kind(render(), "Deployment").items() if "-worker-" in name)
    assert _container(worker)["resources"] == defaults
    deployments = _by_kind(render(TWO_MODELS), "Deployment")
    assert _container(deployments["tokenrelay-worker-llama-8b"])["resources"] == defaults
    assert _container(deployments["tokenrelay-worker-qwen-05b"])["resources"] == {
        "requests": {"nvidia.com/gpu": 1, "cpu": "2", "memory": "8Gi"},
        "limits": {"nvidia.com/gpu": 1, "memory": "16Gi"},
    }
    assert _container(deployments["tokenrelay-gateway"])["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }


def _shm(deployment: dict) -> str:
    """The size of the memory emptyDir the worker mounts at /dev/shm."""
    spec, container = deployment["spec"]["template"]["spec"], _container(deployment)
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    (volume,) = (v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    return volume["emptyDir"]["sizeLimit"]


def test_a_model_split_across_gpus_asks_for_one_per_rank_and_a_larger_shm(render):
    """tensorParallelSize N: --tensor-parallel-size N, nvidia.com/gpu N requested and limited (over the defaults'
    1, or added to a model's own resources), a /dev/shm for NCCL between the ranks' processes; the rest as before."""
    worker = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]
    deployments = _by_kind(
        render({"models": [{"name": "split", "tensorParallelSize": 2}, {"name": "whole"}]}), "Deployment"
    )
    split, whole = deployments["tokenrelay-worker-split"], deployments["tokenrelay-worker-whole"]
    assert _env(_container(split))["TOKENRELAY_TENSOR_PARALLEL_SIZE"] == "2"
    assert _settings(split).model.tensor_parallel_size == 2
    assert _container(split)["resources"] == {
        "requests": {"nvidia.com/gpu": 2, "cpu": "2", "memory": "16Gi"},
        "limits": {"nvidia.com/gpu": 2, "memory": "16Gi"},
    }
    assert _shm(split) == worker["tensorParallelShmSize"] == "8Gi"
    (default,) = (d for name, d in _by_kind(render(), "Deployment").items() if "-worker-" in name)
    for deployment in (default, whole):  # one GPU, one process, the shm of one
        assert "TOKENRELAY_TENSOR_PARALLEL_SIZE" not in _env(_container(deployment))
        assert _settings(deployment).model.tensor_parallel_size == 1
        assert _container(deployment)["resources"] == worker["resources"]
        assert _shm(deployment) == worker["shmSize"] == "2Gi"
    (llama,) = (d for name, d in _by_kind(render(LLAMA_70B), "Deployment").items() if "-worker-" in name)
    assert _settings(llama).model.tensor_parallel_size == 8
    assert _container(llama)["resources"] == {
        "requests": {"nvidia.com/gpu": 8, "cpu": "16", "memory": "96Gi"},
        "limits": {"nvidia.com/gpu": 8, "memory": "96Gi"},
    }
    assert _shm(llama) == "8Gi"
    # On the CPU the ranks share its cores: no GPU asked for. A model's own shmSize wins.
    resources = {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    cpu = {"name": "cpu", "tensorParallelSize": 4, "env": {"device": "cpu"}, "resources": resources, "shmSize": "3Gi"}
    (deployment,) = (d for name, d in _by_kind(render({"models": [cpu]}), "Deployment").items() if "-worker-" in name)
    assert _settings(deployment).model.tensor_parallel_size == 4
    assert _container(deployment)["resources"] == resources
    assert _shm(deployment) == "3Gi"


# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards), as the admission controller
# applies "restricted" to a pod: the baseline's controls on host access and privileges, then restricted's own.
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected"}
_RESTRICTED_VOLUMES |= {"secret"}


def _refused_by_restricted(pod: dict) -> list[str]:
    """What Pod Security "restricted" refuses in a pod template, each control named as the standard names it
    (AppArmor, SELinux, /proc mounts and sysctls aside: the chart sets none of them)."""
    spec = pod["spec"]
    refused = [f"Host Namespaces: {field}" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    for volume in spec.get("volumes", []):
        (source,) = set(volume) - {"name"}
        if source not in _RESTRICTED_VOLUMES:
            refused.append(f"Volume Types: {volume['name']} is a {source}")
    pod_context = spec.get("securityContext", {})
    for container in spec.get("initContainers", []) + spec["containers"]:
        name, context = container["name"], container.get("securityContext", {})

        def setting(field: str, context=context):  # the container's, else the pod's
            return context.get(field, pod_context.get(field))

        if context.get("privileged"):
            refused.append(f"Privileged Containers: {name}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            refused.append(f"HostPorts: {name}")
        if context.get("allowPrivilegeEscalation") is not False:
            refused.append(f"Privilege Escalation: {name} does not set allowPrivilegeEscalation false")
        if setting("runAsNonRoot") is not True:
            refused.append(f"Running as Non-root: {name}")
        if setting("runAsUser") == 0:
            refused.append(f"Running as Non-root user: {name} runs as uid 0")
        if (setting("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            refused.append(f"Seccomp: {name} has no RuntimeDefault or Localhost profile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            refused.append(f"Capabilities: {name} does not drop ALL, or adds more than NET_BIND_SERVICE")
    return refused


def test_every_pod_passes_pod_security_restricted(rendered):
    for name, deployment in _by_kind(rendered, "Deployment").items():
        assert _refused_by_restricted(deployment["spec"]["template"]) == [], name


def test_the_restricted_check_refuses_what_the_standard_refuses():
    pod = {
        "spec": {
            "hostNetwork": True,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {"name": "root", "securityContext": {"runAsNonRoot": False, "runAsUser": 0}},
                {
                    "name": "open",
                    "ports": [{"containerPort": 80, "hostPort": 80}],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
                        "seccompProfile": {"type": "Unconfined"},
                    },
                },
            ],
            "volumes": [{"name": "cache", "hostPath": {"path": "/var/cache"}}, {"name": "tmp", "emptyDir": {}}],
        }
    }
    assert _refused_by_restricted(pod) == [
        "Host Namespaces: hostNetwork",
        "Volume Types: cache is a hostPath",
        "Privilege Escalation: root does not set allowPrivilegeEscalation false",
        "Running as Non-root: root",
        "Running as Non-root user: root runs as uid 0",
        "Capabilities: root does not drop ALL, or adds more than NET_BIND_SERVICE",
        "HostPorts: open",
        "Seccomp: open has no RuntimeDefault or Localhost profile",
        "Capabilities: open does not drop ALL, or adds more than NET_BIND_SERVICE",
    ]


def test_pods_run_as_the_images_user_on_a_read_only_root_with_writable_scratch(rendered):
    """The uid is the image's (a kubelet runs a numeric USER as is); what the processes write has a volume."""
    dockerfile = _dockerfile()
    (user,) = [args for instruction, args in dockerfile if instruction == "USER"]
    uid, gid = (int(n) for n in user.split(":"))
    home = next(args for instruction, args in dockerfile if instruction == "ENV" and args.startswith("HOME="))
    for name, deployment in _by_kind(rendered, "Deployment").items():
        spec, container = deployment["spec"]["template"]["spec"], _container(deployment)
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "fsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        }, name
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }, name
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        assert mounts["/tmp"]["emptyDir"] == {"sizeLimit": "1Gi"}, name
        if container["command"] == ["tokenrelay", "worker"]:
            assert mounts[home.removeprefix("HOME=")]["emptyDir"] == {}, name  # caches: no limit by default


def test_services_and_monitors_select_the_pods_they_mean(render):
    docs = render(TWO_MODELS)
    pods = [d["spec"]["template"] for d in _by_kind(docs, "Deployment").values()]

    def selected(selector: dict) -> list[dict]:
        return [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]

    services = _by_kind(docs, "Service")
    for name, service in services.items():
        chosen = selected(service["spec"]["selector"])
        assert chosen, name
        for pod in chosen:
            (container,) = pod["spec"]["containers"]
            names = {p["name"] for p in container["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, name
    assert len(selected(services["tokenrelay-worker-metrics"]["spec"]["selector"])) == 2
    for monitor in _by_kind(docs, "ServiceMonitor").values():
        matched = [
            s
            for s in services.values()
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert len(matched) == 1
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in matched[0]["spec"]["ports"]}
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for pdb in _by_kind(docs, "PodDisruptionBudget").values():
        assert len(selected(pdb["spec"]["selector"]["matchLabels"])) == 1


def test_strimzi_runs_kraft_with_a_node_pool_of_three_that_every_process_can_write_to(render):
    """Every process's topics fit the cluster: replicated at most once per broker (or creating them fails), at
    least as often as an acks=all write needs copies (min.insync.replicas), with room for its largest message."""
    for values in ((), (STRIMZI_V1BETA2,)):
        docs = render(*values)
        (kafka,) = _by_kind(docs, "Kafka").values()
        (pool,) = _by_kind(docs, "KafkaNodePool").values()
        assert pool["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
        assert pool["spec"]["replicas"] == 3 and set(pool["spec"]["roles"]) == {"controller", "broker"}
        if kafka["apiVersion"].endswith("v1beta2"):  # node pools and KRaft are opt-in there
            assert kafka["metadata"]["annotations"] == {
                "strimzi.io/node-pools": "enabled",
                "strimzi.io/kraft": "enabled",
            }
        config = kafka["spec"]["kafka"]["config"]
        deployments = _by_kind(docs, "Deployment").values()
        assert len(deployments) == 2  # the gateway, the bundled model's workers
        for deployment in deployments:
            bus = _settings(deployment).bus
            assert (config["min.insync.replicas"], bus.replication_factor, pool["spec"]["replicas"]) == (2, 3, 3)
            assert bus.max_message_bytes <= config["message.max.bytes"]


def test_the_chart_refuses_what_cannot_work(render):
    with pytest.raises(AssertionError, match="kafka.bootstrap"):
        render({"kafka": {"strimzi": {"enabled": False}}})
    with pytest.raises(AssertionError, match="DNS label"):
        render({"models": [{"name": "Llama_8B"}]})
    with pytest.raises(AssertionError, match="listed twice"):
        render({"models": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(AssertionError, match="both hubId and path"):
        render({"models": [{"name": "a", "hubId": "x/y", "path": "/m"}]})
    for size in (0, 65, 2.5):
        with pytest.raises(AssertionError, match="tensorParallelSize"):
            render({"models": [{"name": "a", "tensorParallelSize": size}]})
    with pytest.raises(AssertionError, match="not env tensor-parallel-size"):
        render({"models": [{"name": "a", "tensorParallelSize": 2, "env": {"tensor-parallel-size": 4}}]})
    one_gpu = {"requests": {"nvidia.com/gpu": 1, "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    with pytest.raises(AssertionError, match="one GPU per rank"):
        render({"models": [{"name": "a", "tensorParallelSize": 2, "resources": one_gpu}]})
    with pytest.raises(AssertionError, match="no time to drain"):
        render({"gateway": {"terminationGracePeriodSeconds": 15}})


def test_grace_periods_leave_time_to_drain(rendered):
    """The pod is killed terminationGracePeriodSeconds after the preStop hook starts: the preStop sleep,
    --drain-timeout and the last seconds of closing must fit in it."""
    for deployment in _by_kind(rendered, "Deployment").values():
        spec, container = deployment["spec"]["template"]["spec"], _container(deployment)
        drain_timeout_s = _settings(deployment).drain_timeout_s
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pre_stop[0] == "sleep"
        assert drain_timeout_s >= 10
        assert int(pre_stop[1]) + drain_timeout_s + 10 <= spec["terminationGracePeriodSeconds"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    gateway = next(d for d in _by_kind(rendered, "Deployment").values() if _container(d)["command"][1] == "gateway")
    assert (
        gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        == (values["gateway"]["terminationGracePeriodSeconds"])
    )
