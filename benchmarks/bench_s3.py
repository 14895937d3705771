"""S3: our save and load through a real HTTP S3 endpoint on loopback, against that endpoint's raw rate
measured in the same run.

The endpoint is ``moto_server`` on 127.0.0.1 (a subprocess of this run, killed at its end, and on
Linux also when this process dies). One process, no process group, saves ``--s3-mib`` MiB of fp32
matrices to ``s3://bench/run`` and loads them back. Then boto3 PUTs and GETs the same number of
objects with the same sizes (taken by listing the step's prefix after our save) from a thread pool,
against the same endpoint: the rate a client of this endpoint can reach, our ceiling.

Why one process and not a world of 2: the endpoint is a Python server that needs a core of its
own, and this machine has two; a second rank would compete with the server it measures. The raw
client is one process too, so both sides see the same endpoint under the same load.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from bench_common import (
    alternate,
    blocked_fields,
    emit,
    ratio_line,
    result_line,
    run_world,
    timed,
    timed_save_resilient,
)

log = logging.getLogger("ckpt_bench.s3")
WIDTH = 2048  # columns of each fp32 matrix: 16 MiB per full matrix, one shard object each
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL", "NO_PROXY", "no_proxy")
# Sets "kill me when my parent dies" (PR_SET_PDEATHSIG = 1), then becomes moto_server: no server
# outlives a run killed with SIGKILL, where no finally clause runs. A preexec_fn would do the same
# between fork and exec, which is unsafe in a process that has threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); os.execv(sys.argv[1], sys.argv[1:])"
)


@dataclass(kw_only=True, slots=True)
class S3Config:
    mib: int = 256
    """State saved, in MiB (fp32 matrices of WIDTH columns; the last may have fewer rows)."""
    repeats: int = 2
    """Measured rounds, after one untimed warm-up round."""
    timeout_s: float = 1800.0
    """Longest the process may run before it is killed (and each save's or transfer's wait)."""
    threads: int = 32
    """Threads of the raw boto3 PUT/GET pool (and its connection pool): every object in flight."""
    bucket: str = "bench"
    prefix: str = "run"

    def __post_init__(self) -> None:
        if not 1 <= self.mib <= 1 << 16:
            raise ValueError(f"s3 mib must be in [1, 65536], got {self.mib}")
        if not 1 <= self.repeats <= 100:
            raise ValueError(f"repeats must be in [1, 100], got {self.repeats}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 1 <= self.threads <= 256:
            raise ValueError(f"threads must be in [1, 256], got {self.threads}")

    def step_prefix(self, step: int) -> str:
        from resilient.manifest import step_dir

        return f"{self.prefix}/{step_dir(step)}/"


# ---------------------------------------------------------------------------------------------
# the endpoint (parent process)


def moto_path() -> str:
    return os.path.join(os.path.dirname(sys.executable), "moto_server")


def moto_available() -> bool:
    """moto_server beside this Python (the venv's bin) and boto3 importable."""
    return os.access(moto_path(), os.X_OK) and importlib.util.find_spec("boto3") is not None


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited early with code {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"moto_server did not listen on 127.0.0.1:{port} within {timeout_s} s")


@contextlib.contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """A moto_server on 127.0.0.1 and the AWS_* environment pointing at it (inherited by worlds
    spawned inside the block); yields the endpoint URL. The server is killed on leaving."""
    from resilient.dist import free_port

    port = free_port()
    command = [moto_path(), "-H", "127.0.0.1", "-p", str(port)]
    if sys.platform == "linux":
        command = [sys.executable, "-c", _DIE_WITH_PARENT, *command]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in _ENV}
    endpoint = f"http://127.0.0.1:{port}"
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
            NO_PROXY="127.0.0.1,localhost",  # loopback only, even where a proxy is configured
            no_proxy="127.0.0.1,localhost",
        )
        _wait_for_port(port, proc, timeout_s)
        log.info("moto_server pid %d on %s", proc.pid, endpoint)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# the process (spawned, no process group)


def s3_state(cfg: S3Config, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows_left = cfg.mib * (1 << 20) // (4 * WIDTH)
    layers, i = {}, 0
    while rows_left > 0:
        rows = min(WIDTH, rows_left)
        layers[f"layers.{i}.weight"] = torch.randn(rows, WIDTH, generator=gen)
        rows_left, i = rows_left - rows, i + 1
    return {"model": layers}


def _raw_client(cfg: S3Config) -> Any:
    import boto3
    from botocore.config import Config

    # Flexible checksums off: the client hashing every body would measure boto3, not the endpoint.
    config = Config(
        max_pool_connections=cfg.threads,
        connect_timeout=10,
        read_timeout=120,
        retries={"max_attempts": 3, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1", config=config)


def _list(client: Any, bucket: str, prefix: str) -> list[tuple[str, int]]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [(o["Key"], o["Size"]) for page in pages for o in page.get("Contents", [])]


def _delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    keys = [k for k, _ in _list(client, bucket, prefix)]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


def _in_parallel(pool: ThreadPoolExecutor, fn: Callable, items: list, timeout_s: float) -> list:
    futures = [pool.submit(fn, *item) for item in items]
    _, pending = wait(futures, timeout=timeout_s)
    if pending:
        for f in pending:
            f.cancel()
        raise TimeoutError(f"{len(pending)} of {len(futures)} S3 requests not done within {timeout_s:.0f} s")
    return [f.result() for f in futures]


def _raw_round(cfg: S3Config, client: Any, pool: ThreadPoolExecutor, payloads: list[bytes]) -> dict[str, float]:
    """PUT every payload as its own object, then GET them all back, each from the thread pool."""
    keys = [f"raw/{i:06d}" for i in range(len(payloads))]

    def put(key: str, body: bytes) -> None:
        client.put_object(Bucket=cfg.bucket, Key=key, Body=body)

    def get(key: str, size: int) -> None:
        got = len(client.get_object(Bucket=cfg.bucket, Key=key)["Body"].read())
        if got != size:
            raise AssertionError(f"raw GET of {key}: {got} bytes, expected {size}")

    put_s = timed(lambda: _in_parallel(pool, put, list(zip(keys, payloads, strict=True)), cfg.timeout_s))
    sizes = [len(p) for p in payloads]
    get_s = timed(lambda: _in_parallel(pool, get, list(zip(keys, sizes, strict=True)), cfg.timeout_s))
    _delete_prefix(client, cfg.bucket, "raw/")
    return {"raw_put": put_s, "raw_get": get_s}


def _ours_round(cfg: S3Config, ckpt: Any, step: int, state: dict, dest: dict) -> dict[str, float]:
    import torch

    blocked, save_s, _ = timed_save_resilient(ckpt, state, step, timeout_s=cfg.timeout_s)
    for t in dest["model"].values():
        t.zero_()
    load_s = timed(lambda: ckpt.load(dest, step=step))
    bad = [k for k, v in state["model"].items() if not torch.equal(dest["model"][k], v)]
    if bad:
        raise AssertionError(f"S3 load of step {step}: tensors {bad[:3]} differ from the saved ones")
    return {"save": save_s, "save_blocked": blocked, "load": load_s}


def s3_world(rank: int, world: int, cfg: S3Config) -> dict:
    import torch

    from resilient import Checkpointer

    state = s3_state(cfg)
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    client = _raw_client(cfg)
    client.create_bucket(Bucket=cfg.bucket)
    times: dict[str, list[float]] = {}
    objects: list[tuple[str, int]] = []
    payloads: list[bytes] = []
    with (
        Checkpointer(f"s3://{cfg.bucket}/{cfg.prefix}") as ckpt,
        ThreadPoolExecutor(cfg.threads, thread_name_prefix="raw-s3") as pool,
    ):
        for step in range(cfg.repeats + 1):  # step 0: the untimed warm-up; it runs ours first
            seconds: dict[str, float] = {}
            for side in alternate(step, "resilient", "raw"):
                if side == "resilient":
                    seconds.update(_ours_round(cfg, ckpt, step, state, dest))
                    objects = _list(client, cfg.bucket, cfg.step_prefix(step))
                    if not payloads:  # untimed: the bodies exist in memory before the clock starts
                        blob = os.urandom(max(size for _, size in objects))
                        payloads = [blob[:size] for _, size in objects]
                else:
                    seconds.update(_raw_round(cfg, client, pool, payloads))
            log.info("s3 round %d (%d objects): %s", step, len(objects), {k: round(v, 3) for k, v in seconds.items()})
            if step > 0:
                for name, value in seconds.items():
                    times.setdefault(name, []).append(value)
                _delete_prefix(client, cfg.bucket, cfg.step_prefix(step - 1))
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    return {"bytes": nbytes, "objects": len(objects), "object_bytes": sum(s for _, s in objects), "seconds": times}


# ---------------------------------------------------------------------------------------------
# the parent


def run_s3(cfg: S3Config) -> None:
    """Start the endpoint, run the case in one spawned process, print its lines; the endpoint is
    gone when this returns or raises."""
    if not moto_available():
        raise RuntimeError(f"--s3 needs moto_server at {moto_path()} and boto3: pip install 'moto[server]' boto3")
    log.info("s3: %d MiB in one process against moto_server on 127.0.0.1", cfg.mib)
    with moto_server():
        result = run_world(s3_world, 1, cfg, process_group=False)[0]
    world, seconds = 1, result["seconds"]
    objects = {"objects": result["objects"], "objects_per_rank": result["objects"] // world}
    ours = {
        op: {**result_line(f"{op}_s3", "resilient", result["bytes"], seconds[op], from_world=1, to_world=1), **objects}
        for op in ("save", "load")
    }
    ours["save"].update(blocked_fields(seconds["save_blocked"]))
    raw = {
        op: {
            **result_line(
                "limit", f"s3_raw_{op}", result["object_bytes"], seconds[f"raw_{op}"], from_world=1, to_world=1
            ),
            **objects,
            "threads": cfg.threads,
        }
        for op in ("put", "get")
    }
    for line in (ours["save"], ours["load"], raw["put"], raw["get"]):
        emit(line)
    emit(ratio_line("save_s3_over_raw_put", ours["save"], raw["put"]))
    emit(ratio_line("load_s3_over_raw_get", ours["load"], raw["get"]))
