"""Render the Kubernetes manifests of an unbroken job: a JobSet, its controller's headless
Service and the entrypoint's ConfigMap, from a values file; with ``controllerFailover.enabled``,
also the job's own etcd (a StatefulSet and its headless Service) for ``--controller-store``.

    python deploy/k8s/render.py [--values FILE]... [--set KEY=VALUE]... [--out FILE]

Defaults come from ``values.yaml`` beside this file; each ``--values`` file and then each
``--set`` (``memoryTier.stateBytesPerRank=6Gi``) overrides them. Every value is checked, and
so is the resulting ``unbroken run`` command line, with unbroken's own parser: a bad value
exits 2 naming the key, the value and what is allowed, and nothing is written.

It runs where you develop (it imports unbroken, torch and PyYAML), not in the cluster. The values
are read and checked by k8s_values.py beside this file; this file builds the manifests and the
command line. Why a renderer and not a Helm chart: see docs/operations.md, "Running on Kubernetes".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script it is there; loaded by path (the tests) it is not
    sys.path.insert(0, str(HERE))

from k8s_values import (SUB_HEALTHY, RenderError, check_values, controller_host, etcd_hosts, etcd_name,
                        load_values, persist_every_steps, shared_storage, shm_size_bytes,
                        sigterm_dump_timeout_s, termination_grace_s)

ENTRYPOINT = HERE.parent / "unbroken-entrypoint.sh"
ENTRYPOINT_DIR = "/opt/unbroken"
CONTAINER = "unbroken"  # the podFailurePolicy rules name it
NODE_JOB, STANDBY_JOB = "node", "standby"
EXIT_USAGE = 2
SECRET_KEY = "UNBROKEN_JOB_SECRET"


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


# ----------------------------------------------------------------------------- the command

def run_args(values: dict[str, Any], *, standby: bool = False) -> list[str]:
    """The ``unbroken run`` command line of one pod; $(UNBROKEN_NODE_RANK) is expanded by the kubelet."""
    storage, tier = values["storage"], values["memoryTier"]
    mount = storage["mountPath"].rstrip("/")
    checkpoints = f"{mount}/checkpoints/{values['name']}"
    args = ["unbroken", "run",
            "--nnodes", str(values["nodes"]), "--nproc-per-node", str(values["procPerNode"]),
            "--master-addr", controller_host(values), "--master-port", str(values["controlPort"]),
            "--rdzv-id", values["name"],
            "--run-dir", f"{mount}/runs/{values['name']}",
            # --load the same directory: pods made again by a JobSet restart resume from the newest
            # checkpoint there (the SIGTERM dump of an evicted job, or the last persisted step).
            "--save", checkpoints, "--load", checkpoints,
            "--sigterm-dump-timeout-s", f"{sigterm_dump_timeout_s(values):g}",
            "--ckpt-every-steps", str(tier["everySteps"]),
            "--persist-every-steps", str(persist_every_steps(values)),
            "--keep-checkpoints", str(storage["keepCheckpoints"]),
            "--shm-dir", "/dev/shm",
            "--max-restarts", str(values["maxRestarts"]),
            "--recover-strategy", str(values["recoverStrategy"]),
            "--sub-health-policy", SUB_HEALTHY[values["subHealthyStrategy"]]]
    args += ["--standby"] if standby else ["--node-rank", "$(UNBROKEN_NODE_RANK)"]
    if values["metricsPort"] and not standby:
        args += ["--metrics-port", str(values["metricsPort"])]
    failover = values["controllerFailover"]
    if failover["enabled"]:
        port = failover["etcd"]["clientPort"]
        args += ["--controller-store", "etcd://" + ",".join(f"{host}:{port}" for host in etcd_hosts(values)),
                 "--controller-lease-s", str(failover["leaseSeconds"])]
    args += [str(a) for a in values["extraArgs"]]
    return args + [values["script"], *(str(a) for a in values["scriptArgs"])]


def _raising_parser() -> argparse.ArgumentParser:
    """`unbroken run`'s own parser (its flags before the script, the script's words after it), whose
    usage errors raise RenderError instead of printing and exiting."""
    from unbroken.cli.main import Parser

    class RaisingParser(Parser):
        def error(self, message: str) -> None:  # argparse would print and exit: report instead
            raise RenderError(message)

    return RaisingParser(prog="unbroken run", launches_script=True)


def check_command(args: list[str], *, warn: Callable[[str], None] = _warn) -> None:
    """Parse ``args`` (``unbroken run ...``) with unbroken's own flags and config checks, as
    node 0 would see them; RenderError on a usage error. Only `warn` is told anything."""
    from unbroken.cli.main import add_run_flags, launch_config
    from unbroken.errors import ConfigError
    from unbroken.worker_config import ENV_SECRET

    parser = _raising_parser()
    add_run_flags(parser)
    flags = [a.replace("$(UNBROKEN_NODE_RANK)", "0") for a in args[2:]]
    if "--shm-dir" in flags:  # the pod's /dev/shm; the machine rendering may have none (macOS)
        flags[flags.index("--shm-dir") + 1] = tempfile.gettempdir()
    if "--metrics-port" in flags and "--metrics-port" not in parser.format_help():
        warn("render.py: warning: this unbroken has no `unbroken run --metrics-port` yet; the image's "
             "unbroken must have it, or render with --set metricsPort=0")
        i = flags.index("--metrics-port")
        del flags[i:i + 2]
    shown = " ".join(args)
    try:
        namespace = parser.parse_args(flags)
        # --nnodes > 1 needs the job secret in the environment: the pods get it from the Secret.
        saved = os.environ.get(ENV_SECRET)
        os.environ[ENV_SECRET] = saved or "render-check-" + "0123456789abcdef" * 2  # strong enough for the multi-node rule
        try:
            launch_config(namespace)
        finally:
            if saved is None:
                del os.environ[ENV_SECRET]
    except (RenderError, ConfigError) as exc:
        raise RenderError(f"the rendered command `{shown}` is not valid: {exc}") from None


# ----------------------------------------------------------------------------- manifests

def _labels(values: dict[str, Any]) -> dict[str, str]:
    return {"app.kubernetes.io/name": "unbroken", "app.kubernetes.io/instance": values["name"],
            # MindCluster's labels, for tools that read them; unbroken reads the flags.
            "fault-scheduling": str(values["faultScheduling"]),
            "subHealthyStrategy": str(values["subHealthyStrategy"])}


def _meta(values: dict[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": values["namespace"], "labels": _labels(values), **extra}


def entrypoint_configmap(values: dict[str, Any]) -> dict[str, Any]:
    """The entrypoint script (deploy/unbroken-entrypoint.sh), mounted into every pod: the image
    needs only unbroken, not this file."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(values, f"{values['name']}-entrypoint"),
            "data": {ENTRYPOINT.name: ENTRYPOINT.read_text(encoding="utf-8")}}


def controller_service(values: dict[str, Any]) -> dict[str, Any]:
    """The headless Service that names node 0's pod: every agent's --master-addr, and the
    Prometheus scrape target. Not-ready pods are published: the controller must be reachable
    while it starts."""
    ports = [{"name": "control", "port": values["controlPort"], "targetPort": "control", "protocol": "TCP"}]
    annotations = {}
    if values["metricsPort"]:
        ports.append({"name": "metrics", "port": values["metricsPort"], "targetPort": "metrics",
                      "protocol": "TCP"})
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(values["metricsPort"])}
    selector = {"jobset.sigs.k8s.io/jobset-name": values["name"],
                "jobset.sigs.k8s.io/replicatedjob-name": NODE_JOB,
                "batch.kubernetes.io/job-completion-index": "0"}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(values, controller_host(values), **({"annotations": annotations} if annotations else {})),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector, "ports": ports}}


def etcd_manifests(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's own etcd: a headless Service naming each member, and a StatefulSet of
    ``controllerFailover.etcd.members`` pods started together (the cluster bootstraps with all of
    them), each with a volume of its own (a restarted member keeps its data and rejoins)."""
    etcd, name = values["controllerFailover"]["etcd"], etcd_name(values)
    client, peer = etcd["clientPort"], etcd["peerPort"]
    selector = {"app.kubernetes.io/name": "unbroken-etcd", "app.kubernetes.io/instance": values["name"]}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(values, name),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector,
                        "ports": [{"name": "client", "port": client, "targetPort": "client", "protocol": "TCP"},
                                  {"name": "peer", "port": peer, "targetPort": "peer", "protocol": "TCP"}]}}
    me = f"$(POD_NAME).{name}.{values['namespace']}.svc"
    members = ",".join(f"{name}-{i}=http://{host}:{peer}" for i, host in enumerate(etcd_hosts(values)))
    container = {"name": "etcd", "image": etcd["image"], "imagePullPolicy": values["imagePullPolicy"],
                 "command": ["etcd"],
                 "args": ["--name=$(POD_NAME)", "--data-dir=/var/lib/etcd/data",
                          f"--listen-client-urls=http://0.0.0.0:{client}", f"--advertise-client-urls=http://{me}:{client}",
                          f"--listen-peer-urls=http://0.0.0.0:{peer}", f"--initial-advertise-peer-urls=http://{me}:{peer}",
                          f"--initial-cluster={members}", "--initial-cluster-state=new",
                          f"--initial-cluster-token={name}",
                          # the job writes a few hundred bytes per committed step: keep 10k revisions, not all
                          "--auto-compaction-mode=revision", "--auto-compaction-retention=10000"],
                 "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                 "ports": [{"name": "client", "containerPort": client, "protocol": "TCP"},
                           {"name": "peer", "containerPort": peer, "protocol": "TCP"}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 5},
                 "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}]}
    if etcd["resources"]:
        container["resources"] = etcd["resources"]
    claim = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": str(etcd["storageSize"])}}}
    if etcd["storageClassName"]:
        claim["storageClassName"] = etcd["storageClassName"]
    pod: dict[str, Any] = {"containers": [container]}
    for key in ("nodeSelector", "tolerations"):
        if values[key]:
            pod[key] = values[key]
    statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(values, name),
                   "spec": {"serviceName": name, "replicas": etcd["members"], "podManagementPolicy": "Parallel",
                            "selector": {"matchLabels": selector},
                            "template": {"metadata": {"labels": {**_labels(values), **selector}}, "spec": pod},
                            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": claim}]}}
    return [service, statefulset]


def _container(values: dict[str, Any], *, standby: bool) -> dict[str, Any]:
    env = [{"name": SECRET_KEY, "valueFrom": {"secretKeyRef": {"name": values["secretName"], "key": SECRET_KEY}}},
           {"name": "UNBROKEN_WAIT_FOR_HOST", "value": controller_host(values)}]
    if not standby:  # the pod's index in the Indexed Job is its node rank
        env.append({"name": "UNBROKEN_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
    ports = [{"name": "control", "containerPort": values["controlPort"], "protocol": "TCP"}]
    if values["metricsPort"]:
        ports.append({"name": "metrics", "containerPort": values["metricsPort"], "protocol": "TCP"})
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "entrypoint", "mountPath": ENTRYPOINT_DIR, "readOnly": True},
              {"name": "storage", "mountPath": values["storage"]["mountPath"]}]
    container = {"name": CONTAINER, "image": values["image"], "imagePullPolicy": values["imagePullPolicy"],
                 "workingDir": values["workingDir"],
                 "command": ["bash", f"{ENTRYPOINT_DIR}/{ENTRYPOINT.name}"],
                 "args": run_args(values, standby=standby),
                 "env": env + list(values["env"]), "ports": ports, "volumeMounts": mounts}
    if values["resources"]:
        container["resources"] = values["resources"]
    return container


def _pod_spec(values: dict[str, Any], *, standby: bool) -> dict[str, Any]:
    grace = termination_grace_s(values)
    claim = values["storage"]["claimName"]
    storage = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    spec = {"restartPolicy": "Never",  # unbroken restarts its workers itself; a failed pod is the Job's
            "terminationGracePeriodSeconds": grace,
            "containers": [_container(values, standby=standby)],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_size_bytes(values) >> 20}Mi"}},
                {"name": "entrypoint", "configMap": {"name": f"{values['name']}-entrypoint"}},
                {"name": "storage", **storage}]}
    if values["nodeSelector"]:
        spec["nodeSelector"] = values["nodeSelector"]
    if values["tolerations"]:
        spec["tolerations"] = values["tolerations"]
    return spec


def _replicated_job(values: dict[str, Any], name: str, pods: int, *, standby: bool) -> dict[str, Any]:
    # Exit codes that no new pod can fix end the Job with reason PodFailurePolicy; so does an
    # eviction (DisruptionTarget); the JobSet's rules below tell them apart by the message.
    pod_failure_policy = {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                              "values": [EXIT_USAGE, _exit_fatal()]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
    return {"name": name, "replicas": 1, "template": {"spec": {
        "completionMode": "Indexed", "completions": pods, "parallelism": pods,
        "backoffLimit": 0,  # one failed pod fails the Job: the JobSet decides what follows
        "podFailurePolicy": pod_failure_policy,
        "template": {"metadata": {"labels": _labels(values),
                                  "annotations": {"recover-strategy": str(values["recoverStrategy"])}},
                     "spec": _pod_spec(values, standby=standby)}}}}


def _exit_fatal() -> int:
    from unbroken.errors import EXIT_FATAL

    return EXIT_FATAL


def failure_policy(values: dict[str, Any]) -> dict[str, Any]:
    """Our exit codes -> JobSet actions (first matching rule wins; none matching: RestartJobSet).
    A restart deletes every old pod before it makes new ones (BlockingRecreate): an old node 0
    must not be found under the controller's name by the new agents.

    EXIT_FATAL (97) or a usage error (2) -> FailJobSet; an evicted or preempted pod -> new pods,
    not counted against maxRestarts; any other failure (1: the in-pod restarts were spent, a
    node was lost) -> RestartJobSet, at most jobsetMaxRestarts times. fault-scheduling=off:
    never new pods."""
    fatal = {"name": "fatal", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
             "onJobFailureMessagePatterns": [f"failed with exit code ({EXIT_USAGE}|{_exit_fatal()}) matching FailJob rule"]}
    if values["faultScheduling"] == "off":
        return {"maxRestarts": 0, "rules": [fatal, {"name": "anyFailure", "action": "FailJobSet"}]}
    evicted = {"name": "evicted", "action": "RestartJobSetAndIgnoreMaxRestarts",
               "onJobFailureReasons": ["PodFailurePolicy"],
               "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"]}
    restartable = {"name": "restartable", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]}
    return {"maxRestarts": values["jobsetMaxRestarts"], "restartStrategy": "BlockingRecreate",
            "rules": [fatal, evicted, restartable]}


def jobset(values: dict[str, Any]) -> dict[str, Any]:
    jobs = [_replicated_job(values, NODE_JOB, values["nodes"], standby=False)]
    if values["standbyNodes"]:
        jobs.append(_replicated_job(values, STANDBY_JOB, values["standbyNodes"], standby=True))
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _meta(values, values["name"], annotations={"recover-strategy": str(values["recoverStrategy"])}),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     # The job is done when every node pod is; standby pods then end with it.
                     "successPolicy": {"operator": "All", "targetReplicatedJobs": [NODE_JOB]},
                     "failurePolicy": failure_policy(values),
                     "replicatedJobs": jobs}}


def render(values: dict[str, Any], *, warn: Callable[[str], None] = _warn) -> list[dict[str, Any]]:
    """Every manifest of the job, checked; RenderError on a bad value."""
    check_values(values)
    if values["storage"]["persistEverySteps"] and not shared_storage(values):
        warn("render.py: warning: storage.claimName is empty and the job has several pods: no storage "
             "checkpoints (--persist-every-steps 0), only the memory tier; give a ReadWriteMany claim")
    check_command(run_args(values), warn=warn)
    if values["standbyNodes"]:
        check_command(run_args(values, standby=True), warn=lambda _: None)
    etcd = etcd_manifests(values) if values["controllerFailover"]["enabled"] else []
    return [entrypoint_configmap(values), controller_service(values), *etcd, jobset(values)]


def to_yaml(manifests: list[dict[str, Any]], values: dict[str, Any]) -> str:
    head = (f"# unbroken job {values['name']!r}: rendered by deploy/k8s/render.py; apply with\n"
            f"#   kubectl create secret generic {values['secretName']} -n {values['namespace']} "
            f"--from-literal={SECRET_KEY}=\"$(openssl rand -hex 32)\"\n"
            "#   kubectl apply -f THIS_FILE\n")
    return head + yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the entrypoint script) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", action="append", default=[], metavar="FILE", help="a values file (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one value (repeatable)")
    parser.add_argument("--out", default="-", metavar="FILE", help="where to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        values = load_values(args.values, args.set)
        text = to_yaml(render(values), values)
    except RenderError as exc:
        print(f"render.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
