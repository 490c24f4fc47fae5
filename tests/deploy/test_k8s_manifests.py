"""The Kubernetes manifests of deploy/k8s/render.py, validated offline.

No cluster and no helm here: the core objects are checked against the `kubernetes` client's
models (a round trip that must lose nothing: an unknown or misspelled field, a wrong type or
a missing required field fails), the JobSet against the v1alpha2 CRD schema (vendored in
jobset_v1alpha2_spec_schema.json) plus the client's JobTemplateSpec model for each job; the
container's command line is parsed by unbroken's own `unbroken run` parser; the /dev/shm size
passes unbroken's capacity check on a real tmpfs of that size.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, mounted_tmpfs

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client validates the manifests: "
                                 "pip install kubernetes (a test dependency)")
yaml = pytest.importorskip("yaml", reason="PyYAML reads the values and writes the manifests: pip install pyyaml")

RENDER = REPO / "deploy" / "k8s" / "render.py"
VALUES = REPO / "deploy" / "k8s" / "k8s_values.py"
SCHEMA = json.loads((Path(__file__).parent / "jobset_v1alpha2_spec_schema.json").read_text())["spec"]
# JobSet's FailurePolicyRule.name rule and the Job failure reasons its CEL rule allows.
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
# Kubernetes' label syntax: [prefix/]name, name <= 63 of [A-Za-z0-9_.-] starting and ending alphanumeric.
LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# k8s_values first, under its own name: render.py's `import k8s_values` then finds this module
# rather than loading a second copy (with a second RenderError).
k8s_values = _load("k8s_values", VALUES)
render = _load("unbroken_k8s_render", RENDER)


def _values(**sets: object) -> dict:
    pairs = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sets.items()]
    return k8s_values.load_values([], pairs)


def _manifests(**sets: object) -> dict[str, dict]:
    return {m["kind"]: m for m in render.render(_values(**sets), warn=lambda _: None)}


# ---- schema checks ------------------------------------------------------------------------

def _check_model(data: dict, model: str) -> None:
    """`data` deserialises into the client's `model` and serialises back unchanged."""
    client = kubernetes.client.ApiClient()
    obj = client._ApiClient__deserialize(copy.deepcopy(data), model)  # raises on a missing required field
    assert client.sanitize_for_serialization(obj) == data, f"{model}: fields lost or changed in the round trip"


def _check_schema(data: object, schema: dict, where: str) -> None:
    """The structural-schema subset the JobSet CRD uses; an unknown field is an error (the API
    server would silently prune it)."""
    if "x-validated-by" in schema:
        return
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    assert isinstance(data, types[kind]) and not (kind == "integer" and isinstance(data, bool)), \
        f"{where}: {data!r} is not of type {kind}"
    if "enum" in schema:
        assert data in schema["enum"], f"{where}: {data!r} not one of {schema['enum']}"
    if "minimum" in schema:
        assert data >= schema["minimum"], f"{where}: {data} < {schema['minimum']}"
    if kind == "object" and "properties" in schema:
        unknown = set(data) - set(schema["properties"])
        assert not unknown, f"{where}: unknown fields {sorted(unknown)}"
        missing = set(schema.get("required", ())) - set(data)
        assert not missing, f"{where}: required fields missing {sorted(missing)}"
        for key, value in data.items():
            _check_schema(value, schema["properties"][key], f"{where}.{key}")
    if kind == "array":
        for i, item in enumerate(data):
            _check_schema(item, schema["items"], f"{where}[{i}]")


def _check_labels(node: object) -> None:
    """Every `labels` map anywhere in a manifest has valid keys and values; port names are
    IANA_SVC_NAMEs (<= 15 characters)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("labels", "selector") and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                for name, text in value.items():
                    assert LABEL_NAME.match(name) and LABEL_VALUE.match(text), f"bad label {name}={text!r}"
            if key == "ports":
                assert all(len(p["name"]) <= 15 and p["name"].islower() for p in value), value
            _check_labels(value)
    elif isinstance(node, list):
        for item in node:
            _check_labels(item)


def _check_jobset(jobset: dict) -> None:
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    _check_model(jobset["metadata"], "V1ObjectMeta")
    _check_schema(jobset["spec"], SCHEMA, "spec")
    for job in jobset["spec"]["replicatedJobs"]:
        _check_model(job["template"], "V1JobTemplateSpec")
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        assert RULE_NAME.match(rule["name"]), rule["name"]
        assert set(rule.get("onJobFailureReasons", ())) <= JOB_FAILURE_REASONS
        for pattern in rule.get("onJobFailureMessagePatterns", ()):
            re.compile(pattern)


@pytest.mark.parametrize("sets", [
    {},
    {"nodes": 4, "procPerNode": 8, "standbyNodes": 1, "storage.claimName": "ckpt", "metricsPort": 0},
    {"nodes": 1, "faultScheduling": "off", "subHealthyStrategy": "graceExit", "memoryTier.everySteps": 0,
     "resources": {"limits": {"memory": "16Gi", "cpu": "4"}}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
], ids=["defaults", "standby-claim-no-metrics", "single-node-off"])
def test_rendered_manifests_pass_the_kubernetes_models_and_the_jobset_schema(sets):
    manifests = _manifests(**sets)
    assert sorted(manifests) == ["ConfigMap", "JobSet", "Service"]
    _check_model(manifests["ConfigMap"], "V1ConfigMap")
    _check_model(manifests["Service"], "V1Service")
    _check_jobset(manifests["JobSet"])
    _check_labels(list(manifests.values()))


def _pod(manifests: dict, job: str = "node") -> dict:
    (rjob,) = [j for j in manifests["JobSet"]["spec"]["replicatedJobs"] if j["name"] == job]
    return rjob["template"]["spec"]["template"]


def _expanded_args(container: dict, node_rank: int) -> list[str]:
    """The kubelet's $(VAR) expansion of the container's args, for what a pod's env holds."""
    env = {e["name"]: e.get("value", str(node_rank)) for e in container["env"]}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


def test_every_pod_runs_unbroken_run_with_flags_its_parser_accepts(monkeypatch):
    from unbroken.cli.main import add_run_flags, build_parser, launch_config

    manifests = _manifests(nodes=3, procPerNode=2, **{"storage.claimName": "ckpt"})
    service, pod = manifests["Service"], _pod(manifests)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["bash", "/opt/unbroken/unbroken-entrypoint.sh"]
    args = _expanded_args(container, node_rank=2)
    assert args[:2] == ["unbroken", "run"]
    run_flags = argparse.ArgumentParser()
    add_run_flags(run_flags)
    if "--metrics-port" not in run_flags.format_help():  # issue 16's metrics work adds it; checked once there
        i = args.index("--metrics-port")
        del args[i:i + 2]
    monkeypatch.setenv("UNBROKEN_JOB_SECRET", "from-the-secret-" + "0123456789abcdef" * 2)
    cfg = launch_config(build_parser().parse_args(args[1:]))
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (3, 2, 2)
    # --master-addr is the headless Service, which selects node 0's pod and carries the control port.
    assert cfg.master_addr == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert cfg.master_port == ports["control"] == {p["name"]: p["port"] for p in service["spec"]["ports"]}["control"]
    assert "metrics" in ports and "--metrics-port" in container["args"]
    assert container["args"][container["args"].index("--metrics-port") + 1] == str(ports["metrics"])
    # The secret comes from the Secret, the node rank from the Indexed Job's completion index.
    env = {e["name"]: e for e in container["env"]}
    assert env["UNBROKEN_JOB_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "unbroken-job-secret",
                                                                      "key": "UNBROKEN_JOB_SECRET"}
    assert "job-completion-index" in env["UNBROKEN_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    # /dev/shm is memory-backed, and the checkpoints are on the shared claim.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts[cfg.checkpoint.shm_dir]]["emptyDir"]["medium"] == "Memory"
    assert cfg.checkpoint.save_dir.startswith("/ckpt/") and volumes[mounts["/ckpt"]]["persistentVolumeClaim"]
    assert cfg.checkpoint.persist_every_steps == 10


def test_controller_failover_renders_a_3_member_etcd_and_every_agent_lists_its_members(monkeypatch):
    """controllerFailover.enabled: the job's own etcd (a StatefulSet of 3 members under a headless
    Service, checked against the client's models) and --controller-store with the members' DNS
    names on every pod, node and standby alike, parsed by unbroken's own parser."""
    from unbroken.cli.main import build_parser, launch_config
    from unbroken.consensus.etcd import parse_endpoints

    sets = ["controllerFailover.enabled=true", "standbyNodes=1", "controllerFailover.etcd.clientPort=12379",
            "controllerFailover.etcd.image=registry.example.com/etcd:3.5", "namespace=train"]
    manifests = render.render(k8s_values.load_values([], sets), warn=lambda _: None)
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Service", "Service", "StatefulSet", "JobSet"]
    _, _, service, statefulset, jobset = manifests
    _check_model(service, "V1Service")
    _check_model(statefulset, "V1StatefulSet")
    _check_jobset(jobset)
    _check_labels(manifests)
    spec = statefulset["spec"]
    assert spec["replicas"] == 3 and spec["serviceName"] == service["metadata"]["name"] == "unbroken-gpt-etcd"
    assert spec["podManagementPolicy"] == "Parallel" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"]  # members find each other before they are ready
    assert set(service["spec"]["selector"].items()) <= set(spec["template"]["metadata"]["labels"].items())
    (etcd,) = spec["template"]["spec"]["containers"]
    assert etcd["image"] == "registry.example.com/etcd:3.5"
    hosts = [f"unbroken-gpt-etcd-{i}.unbroken-gpt-etcd.train.svc" for i in range(3)]
    assert f"--initial-cluster={','.join(f'unbroken-gpt-etcd-{i}=http://{h}:2380' for i, h in enumerate(hosts))}" \
        in etcd["args"]
    assert "--advertise-client-urls=http://$(POD_NAME).unbroken-gpt-etcd.train.svc:12379" in etcd["args"]
    assert "--auto-compaction-mode=revision" in etcd["args"]  # a long job's history does not fill etcd's quota
    monkeypatch.setenv("UNBROKEN_JOB_SECRET", "from-the-secret-" + "0123456789abcdef" * 2)
    for job in ("node", "standby"):
        (container,) = _pod({"JobSet": jobset}, job)["spec"]["containers"]
        args = _expanded_args(container, node_rank=1)
        cfg = launch_config(build_parser().parse_args(args[1:]))
        assert parse_endpoints(cfg.controller_store) == [(h, 12379) for h in hosts]
        assert cfg.controller_lease_s == 2
    assert not [m for m in render.render(k8s_values.load_values([], []), warn=lambda _: None)
                if m["kind"] == "StatefulSet"]  # off by default


def test_without_a_shared_claim_a_multi_node_job_writes_no_storage_tier():
    """Each pod's emptyDir is its own: the storage tier's commit needs every rank's files in one place."""
    warnings = []
    manifests = render.render(_values(nodes=2), warn=warnings.append)
    args = _pod({m["kind"]: m for m in manifests})["spec"]["containers"][0]["args"]
    assert args[args.index("--persist-every-steps") + 1] == "0"
    assert any("ReadWriteMany" in w for w in warnings)


@pytest.mark.parametrize("state, nproc", [("64Mi", 1), ("300Mi", 2), ("1Gi", 4)])
def test_shm_size_fits_the_memory_tier_and_is_not_oversized(tmp_path, state, nproc):
    """A tmpfs of the rendered sizeLimit passes unbroken's own check before step 0; 16 MiB less
    does not (the size is what the check needs, not a guess)."""
    from unbroken.checkpoint.capacity import check_shm_capacity
    from unbroken.errors import ShmCapacityError

    values = _values(procPerNode=nproc, **{"memoryTier.stateBytesPerRank": state, "memoryTier.extraBytes": "0"})
    size = k8s_values.shm_size_bytes(values)
    limit = _pod(_manifests(procPerNode=nproc, **{"memoryTier.stateBytesPerRank": state}))["spec"]["volumes"][0]
    assert limit["emptyDir"]["sizeLimit"] == f"{(size >> 20) + 512}Mi"  # + the default extraBytes
    snapshot = k8s_values.parse_quantity("state", state)
    with mounted_tmpfs(tmp_path / "fits", f"{size >> 20}m") as shm:
        check_shm_capacity(shm, "k8sfit", rank=0, snapshot_bytes=snapshot, local_world_size=nproc)
    with mounted_tmpfs(tmp_path / "short", f"{(size >> 20) - 16}m") as shm:
        with pytest.raises(ShmCapacityError):
            check_shm_capacity(shm, "k8sshort", rank=0, snapshot_bytes=snapshot, local_world_size=nproc)


def _first_match(rules: list[dict], reason: str, message: str) -> str:
    """JobSet's rule evaluation: the first rule whose reasons and patterns match; else RestartJobSet."""
    for rule in rules:
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


def _job_failure(pod_policy: dict, *, exit_code: int | None = None, disrupted: bool = False) -> tuple[str, str]:
    """The Job controller's verdict for one failed pod under backoffLimit 0: (reason, message), in
    the formats of Kubernetes' pod failure policy."""
    for i, rule in enumerate(pod_policy["rules"]):
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and exit_code in codes["values"]:
            return "PodFailurePolicy", (f"Container {codes['containerName']} for pod default/p-0 failed with exit code "
                                        f"{exit_code} matching {rule['action']} rule at index {i}")
        conditions = [c["type"] for c in rule.get("onPodConditions", ())]
        if disrupted and "DisruptionTarget" in conditions:
            return "PodFailurePolicy", f"Pod default/p-0 has condition DisruptionTarget matching {rule['action']} rule at index {i}"
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


@pytest.mark.parametrize("scheduling, expected", [
    ("grace", {97: "FailJobSet", 2: "FailJobSet", 1: "RestartJobSet", 130: "RestartJobSet",
               "evicted": "RestartJobSetAndIgnoreMaxRestarts"}),
    ("off", {97: "FailJobSet", 2: "FailJobSet", 1: "FailJobSet", 130: "FailJobSet", "evicted": "FailJobSet"}),
])
def test_exit_codes_map_to_jobset_actions(scheduling, expected):
    from unbroken.errors import EXIT_FATAL

    assert EXIT_FATAL == 97
    jobset = _manifests(faultScheduling=scheduling)["JobSet"]
    (job,) = jobset["spec"]["replicatedJobs"]
    pod_policy, rules = job["template"]["spec"]["podFailurePolicy"], jobset["spec"]["failurePolicy"]["rules"]
    assert job["template"]["spec"]["backoffLimit"] == 0
    got = {code: _first_match(rules, *_job_failure(pod_policy, exit_code=code)) for code in (97, 2, 1, 130)}
    got["evicted"] = _first_match(rules, *_job_failure(pod_policy, exit_code=143, disrupted=True))
    assert got == expected
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == (3 if scheduling == "grace" else 0)


def test_mindcluster_values_map_onto_flags_annotations_and_grace():
    manifests = _manifests(recoverStrategy="retry,dump,exit", subHealthyStrategy="graceExit", faultScheduling="force")
    pod = _pod(manifests)
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--recover-strategy") + 1] == "retry,dump,exit"
    assert args[args.index("--sub-health-policy") + 1] == "grace-exit"
    assert pod["metadata"]["annotations"]["recover-strategy"] == "retry,dump,exit"
    assert pod["metadata"]["labels"]["subHealthyStrategy"] == "graceExit"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5
    assert _pod(_manifests())["spec"]["terminationGracePeriodSeconds"] == 60


@pytest.mark.parametrize("sets, grace_s, dump_s", [
    ({}, 60, 50),  # fault-scheduling grace: 60 s to stop, of which the dump gets all but the 10 s stop
    ({"faultScheduling": "force"}, 5, 0),  # 5 s: no room for a dump, the job stops at once
    ({"terminationGracePeriodSeconds": 30, "sigtermDumpTimeoutSeconds": 12}, 30, 12),
])
def test_the_sigterm_dump_fits_in_the_pods_grace_period_and_new_pods_resume_from_it(sets, grace_s, dump_s):
    pod = _pod(_manifests(**sets))
    args = pod["spec"]["containers"][0]["args"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == grace_s
    assert float(args[args.index("--sigterm-dump-timeout-s") + 1]) == dump_s
    assert dump_s + k8s_values.STOP_AFTER_DUMP_S <= grace_s or dump_s == 0
    assert args[args.index("--load") + 1] == args[args.index("--save") + 1]  # a restarted JobSet resumes


def test_a_sigterm_dump_longer_than_the_grace_period_allows_is_refused(capsys):
    assert render.main(["--set", "terminationGracePeriodSeconds=30", "--set", "sigtermDumpTimeoutSeconds=25"]) == 2
    assert "sigtermDumpTimeoutSeconds: 25 must be null or a number of seconds in [0, 20]" in capsys.readouterr().err


def test_standby_pods_join_with_standby_and_do_not_decide_success():
    jobset = _manifests(standbyNodes=2, **{"storage.claimName": "ckpt"})["JobSet"]
    standby = _pod({"JobSet": jobset}, "standby")
    args = standby["spec"]["containers"][0]["args"]
    assert "--standby" in args and "--node-rank" not in args
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}


@pytest.mark.parametrize("sets, says", [
    (["nodes=0"], "nodes: 0 must be a whole number"),
    (["subHealthyStrategy=forceExit"], "allowed: ignore, graceExit"),
    (["recoverStrategy=retry,teleport"], "unknown strategy 'teleport'"),
    (["recoverStrategy=retry,elastic,exit"], "rung elastic (go on on the nodes left) is not supported by this "
                                             "manifest yet"),
    (["resources.limits.memory=8Gi"], "counts against the container's memory limit"),
    (["memoryTier.stateBytesPerRank=lots"], "is not a byte quantity"),
    (["name=Bad_Name"], "must be a DNS label"),
    (["node=3"], "unknown key 'node'"),  # a typo is an error, not a silently ignored value
    (["storage.claim=ckpt"], "unknown key 'storage.claim'"),
    (["controllerFailover.enabled=true", "controllerFailover.etcd.members=2"], "must be 1, 3 or 5"),
    (["controllerFailover.enabled=true", "nodes=1"], "a single-node job keeps its controller in its own agent"),
    (["controllerFailover.etcd.peerPort=2379"], "is also clientPort"),
])
def test_bad_values_exit_2_naming_the_key(sets, says, capsys):
    assert render.main([a for s in sets for a in ("--set", s)]) == 2
    out, err = capsys.readouterr()
    assert says in err and not out


def test_committed_example_is_what_the_renderer_writes(tmp_path):
    out = tmp_path / "job.yaml"
    assert render.main(["--out", str(out)]) == 0
    assert (REPO / "deploy" / "k8s" / "unbroken-job.yaml").read_text() == out.read_text(), \
        "deploy/k8s/unbroken-job.yaml is stale: python deploy/k8s/render.py --out deploy/k8s/unbroken-job.yaml"
    assert [m["kind"] for m in yaml.safe_load_all(out.read_text())] == ["ConfigMap", "Service", "JobSet"]


def test_the_renderer_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, str(RENDER), "--set", "nodes=1", "--set", "metricsPort=0"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "kind: JobSet" in result.stdout and not result.stderr
