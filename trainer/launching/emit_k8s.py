"""``resilient-train --emit k8s``: one JobSet manifest whose pods each run a ``resilient-train``
(the spec, its checks and the node's command line: ``resilient.trainer.launching.emit``)."""

from __future__ import annotations

import json

from resilient.trainer.launching.emit import (
    RUN_MOUNT,
    EmitSpec,
    check_k8s_run_volume,
    meeting_point,
    node_command,
    shutdown_s,
)

# -- the job's secret (recovery/channel/secret.py; README "Security") -----------------------


def _k8s_job_secret(spec: EmitSpec) -> list[str]:
    """Every pod takes the job secret from one Secret (a pod without it would make its own
    job.key, and heals across pods would be refused); a pod does not start until it exists."""
    name = f"{spec.job_name}-job-secret"
    return [
        f"              # Create once: kubectl create secret generic {name} \\",
        "              #   --from-literal=secret=$(openssl rand -hex 32)",
        "              - name: RESILIENT_JOB_SECRET",
        "                valueFrom:",
        "                  secretKeyRef:",
        f"                    name: {name}",
        "                    key: secret",
        "              - name: RESILIENT_JOB_ID  # a restarted set is the same job (recovery.ownership)",
        f"                value: {_q(spec.job_name)}",
    ]


# -- the JobSet ------------------------------------------------------------------------------


def _q(value: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(value)


def _k8s_container(spec: EmitSpec, endpoint: str) -> list[str]:
    run_dir = ("--set", f"run.dir={RUN_MOUNT}/{spec.job_name}")  # on --run-volume, after the recipe's
    command = node_command(spec, '"$JOB_COMPLETION_INDEX"', f'"{endpoint}"', '"$RDZV_ID"', run_dir)
    lines = [
        "            containers:",
        "            - name: trainer",
        f"              image: {_q(spec.image)}",
        '              command: ["bash", "-c"]',
        "              args:",
        "              - |",
        # The pod's hostname <name>-node-0-<i>: the stable part of its name, kept by a replacement pod.
        '                export RESILIENT_NODE_ID="${RESILIENT_NODE_ID:-$(hostname)}"',
        f"                exec {command}",
        "              ports:",
        f"              - containerPort: {spec.rdzv_port}",
        "              env:",
        "              # JOB_COMPLETION_INDEX (the node rank) is set by the Indexed Job itself.",
        "              - name: RESTART_ATTEMPT",
        "                valueFrom:",
        "                  fieldRef:",
        "                    fieldPath: metadata.annotations['jobset.sigs.k8s.io/restart-attempt']",
        "              - name: RDZV_ID",
        f"                value: {_q(spec.job_name + '-$(RESTART_ATTEMPT)')}",
        "              - name: PYTHONUNBUFFERED",
        '                value: "1"',
        *_k8s_job_secret(spec),
        "              volumeMounts:",
        "              - name: dshm",
        "                mountPath: /dev/shm",
        "              - name: runs",
        f"                mountPath: {RUN_MOUNT}",
    ]
    gpus = [f"                  nvidia.com/gpu: {spec.gpus_per_node}"] if spec.gpus_per_node else []
    return lines + [
        "              resources:",
        "                requests:",
        f'                  cpu: "{spec.cpus}"',
        f"                  memory: {spec.memory}",
        "                limits:",
        f"                  memory: {spec.memory}",
        *gpus,
    ]


def k8s_manifest(spec: EmitSpec) -> str:
    """A JobSet of one Indexed Job with N pods, one ``resilient-train`` each, meeting on pod 0."""
    check_k8s_run_volume(spec)
    name = spec.job_name
    endpoint = f"{name}-node-0-0.{name}:{spec.rdzv_port}"
    lines = [
        f"# resilient: one recipe on {spec.nnodes} nodes x {spec.nproc_per_node} ranks (resilient-train --emit k8s).",
        "# A JobSet (https://jobset.sigs.k8s.io): kubectl apply -f THIS_FILE once the JobSet controller runs.",
        "apiVersion: jobset.x-k8s.io/v1alpha2",
        "kind: JobSet",
        "metadata:",
        f"  name: {name}",
        "spec:",
        "  # A Job that fails for good (a pod lost with its node, backoffLimit spent) restarts the whole",
        "  # set: new pods, RESTART_ATTEMPT + 1, a new rendezvous, resume from the newest common step.",
        "  failurePolicy:",
        f"    maxRestarts: {spec.max_restarts}",
        "  network:",
        f"    # Stable pod DNS names <name>-node-0-<i>.<name>: pod 0 hosts the {meeting_point(spec)}.",
        "    enableDNSHostnames: true",
        "  replicatedJobs:",
        "  - name: node",
        "    replicas: 1",
        "    template:",
        "      spec:",
        f"        parallelism: {spec.max_nodes}",
        f"        completions: {spec.max_nodes}",
        "        completionMode: Indexed",
        f"        backoffLimit: {spec.max_restarts}",
        "        template:",
        "          spec:",
        "            # A crashed launcher restarts in the same pod: its memory-backed /dev/shm, and with",
        "            # it the RAM tier's snapshots, survives a container restart (not a new pod).",
        "            restartPolicy: OnFailure",
        # A pod being stopped (preempted, drained) gets SIGTERM: every rank saves the step it is
        # at within run.preempt_grace_s and exits 143; Kubernetes kills it only after this.
        f"            terminationGracePeriodSeconds: {shutdown_s(spec) + 30}",
        *_k8s_container(spec, endpoint),
        "            volumes:",
        "            - name: dshm",
        "              # RAM tier snapshots; counts against the pod's memory: leave room for it.",
        "              emptyDir:",
        "                medium: Memory",
        f"                sizeLimit: {spec.shm_size}",
        "            - name: runs",
        "              # run.dir (job record, events, the group's timeline) outlives a pod and is one place",
        "              # for all of them: a ReadWriteMany claim (NFS, CephFS, a cloud file store).",
        f"              # run.dir is {RUN_MOUNT}/{spec.job_name}, in place of the recipe's {spec.run_dir}.",
        "              persistentVolumeClaim:",
        f"                claimName: {spec.run_volume}",
        "",
    ]
    return "\n".join(lines)
