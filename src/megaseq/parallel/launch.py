"""Starting the processes of a run: torchrun (read its environment), Ray actors, or local processes.

- torchrun: ``torchrun --nproc-per-node N -m megaseq train cfg.yaml`` sets RANK / WORLD_SIZE /
  LOCAL_RANK / MASTER_ADDR / MASTER_PORT; ``launch`` just runs the training function, and
  ``init_mesh`` reads that environment.
- Ray (``--parallel.launcher ray --parallel.num_workers N``; ``pip install megaseq[ray]``): N actors on
  an existing cluster (``RAY_ADDRESS`` set) or a local one, each given the same environment torchrun
  would set (worker 0's node address and a free port there) and running the same training function.
  A cluster without the CPUs/GPUs for N workers is refused before any actor starts.
- ``spawn_local``: N processes on this machine with that environment (tests, CPU runs without torchrun).
"""

from __future__ import annotations

import copy
import os
import random
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RAY_MISSING = ("parallel.launcher ray needs Ray: pip install 'megaseq[ray]' (or pip install 'ray[train]'), "
               "or launch with torchrun instead")


PORT_FLOOR = 10000  # the lowest port ``free_port`` draws


def ephemeral_ports() -> tuple[int, int]:
    """The range the OS hands out for outgoing connections and port-0 listeners (Linux's
    ``ip_local_port_range``; IANA's 49152-65535 where it cannot be read)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64) -> int:
    """A TCP port free on this host now, drawn at random below the OS's ephemeral range: every connection and
    port-0 listener of every process (the gloo pairs of other jobs included) takes its port from that range, so
    none of them can take this one between the pick and the rendezvous. Two pickers at once collide only by
    drawing the same port. Where no port below the range is free, the OS picks one inside it."""
    lo, _ = ephemeral_ports()
    if lo - PORT_FLOOR > tries:
        for port in random.SystemRandom().sample(range(PORT_FLOOR, lo), tries):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int | None = None,
             local_world_size: int | None = None) -> dict[str, str]:
    """The variables torchrun sets for one process."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def _local_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    from megaseq.console import show_logs

    show_logs()  # a spawned rank starts without the CLI's handler
    os.environ.update(rank_env(rank, world_size, "127.0.0.1", port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    fn(rank, *args)


def spawn_local(fn: Callable[..., Any], world_size: int, args: tuple = (),
                start_method: str | None = None) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` local processes with torchrun's environment.

    ``fork`` (the default on Linux while CUDA is not initialized) starts in milliseconds; ``spawn``
    re-imports everything. An exception in any rank stops the others and is raised here.
    """
    import torch.multiprocessing as mp

    if start_method is None:
        cuda_used = torch.cuda.is_available() and torch.cuda.is_initialized()
        start_method = "fork" if sys.platform == "linux" and not cuda_used else "spawn"
    mp.start_processes(_local_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                       start_method=start_method)


# ---- Ray --------------------------------------------------------------------------------------
def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


def ray_connect(ray: Any, num_cpus: int | None = None) -> bool:
    """Join the cluster at RAY_ADDRESS, or start a local one; True when this call started Ray."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto")
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return True


def check_ray_resources(available: dict[str, float], num_workers: int, cpus_per_worker: float,
                        gpus_per_worker: float) -> None:
    """Refuse a worker count the cluster cannot place (otherwise the actors wait forever)."""
    need_cpu, need_gpu = num_workers * cpus_per_worker, num_workers * gpus_per_worker
    have_cpu, have_gpu = available.get("CPU", 0.0), available.get("GPU", 0.0)
    if need_cpu > have_cpu or need_gpu > have_gpu:
        raise ValueError(
            f"parallel.num_workers = {num_workers} needs {need_cpu:g} CPUs and {need_gpu:g} GPUs "
            f"({cpus_per_worker:g} CPU + {gpus_per_worker:g} GPU per worker), but the Ray cluster has "
            f"{have_cpu:g} CPUs and {have_gpu:g} GPUs: lower --parallel.num_workers or add nodes"
        )


class _RayWorker:
    """One training process; Ray makes it an actor (``ray.remote(...)(_RayWorker)``)."""

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, env: dict[str, str], fn: Callable[..., Any], args: tuple) -> Any:
        from megaseq.console import show_logs

        show_logs()  # the worker's log lines on its stdout / stderr, which Ray forwards
        os.environ.update(env)
        return fn(*args)


def run_ray(fn: Callable[..., Any], args: tuple, num_workers: int, use_gpu: bool | None = None,
            cpus_per_worker: float = 1.0) -> list[Any]:
    """Run ``fn(*args)`` in ``num_workers`` Ray actors forming one torch.distributed world.

    Returns the results in rank order.
    """
    ray = _import_ray()
    started = ray_connect(ray)
    try:
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        gpus = 1.0 if use_gpu else 0.0
        check_ray_resources(ray.cluster_resources(), num_workers, cpus_per_worker, gpus)
        free = ray.available_resources()
        if free.get("CPU", 0.0) < num_workers * cpus_per_worker or free.get("GPU", 0.0) < num_workers * gpus:
            warnings.warn(f"the Ray cluster is busy ({free}): the {num_workers} workers wait for resources",
                          stacklevel=2)
        actor_cls = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus)(_RayWorker)
        workers = [actor_cls.remote() for _ in range(num_workers)]
        try:
            envs = _worker_envs(ray, workers)
            return ray.get([w.run.remote(env, fn, args) for w, env in zip(workers, envs)])
        finally:
            for w in workers:  # free the CPUs/GPUs now, not when the handles are collected
                ray.kill(w)
    finally:
        if started:
            ray.shutdown()


def _worker_envs(ray: Any, workers: list) -> list[dict[str, str]]:
    """torchrun's variables per actor: rank order = actor order, master = worker 0's node and a free port."""
    addr, port = ray.get(workers[0].address.remote())
    nodes = ray.get([w.node.remote() for w in workers])
    envs = []
    for rank, node in enumerate(nodes):
        local = [r for r, n in enumerate(nodes) if n == node]
        envs.append(rank_env(rank, len(workers), addr, port, local.index(rank), len(local)))
    return envs


# ---- the training entry -------------------------------------------------------------------------
def launch(cfg: Any, train_fn: Callable[[Any], Any]) -> Any:
    """Run ``train_fn(cfg)`` as configured: in Ray actors with ``parallel.launcher ray``, else in this
    process (under torchrun each process runs this and reads its environment). The caller gives the
    training function (``megaseq.train.trainer.run_training``): parallel/ sits below train/."""
    if cfg.parallel.launcher != "ray":
        return train_fn(cfg)
    return launch_ray(cfg, train_fn)


def launch_ray(cfg: Any, train_fn: Callable[[Any], Any]) -> Any:
    """``train_fn(cfg)`` in ``parallel.num_workers`` Ray actors; returns rank 0's result."""
    worker_cfg = copy.deepcopy(cfg)
    worker_cfg.parallel.launcher = "torchrun"  # the workers read the environment Ray gives them
    use_gpu = None if cfg.train.device == "auto" else cfg.train.device.startswith("cuda")
    results = run_ray(train_fn, (worker_cfg,), cfg.parallel.num_workers, use_gpu=use_gpu)
    return results[0]
