"""One agent process: load, warm up, bind a ROUTER socket, report ready, serve until told to stop.

Started by the launcher (agent/launcher/model_agents.py) through multiprocessing's spawn context.
Stops on SIGTERM or SIGINT (after the step in flight: the handler only sets a flag), on a `shutdown`
request, or by itself when its parent dies (PR_SET_PDEATHSIG, and a parent-pid check for non-Linux or races).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import signal
import time
import traceback
from dataclasses import replace
from pathlib import Path

import zmq

from agent import kernels
from agent.bootstrap import Placement, build_drafter, build_runner, init_device
from agent.contract.transport import ClientKeys, is_peer, secure_agent_socket
from agent.kernels import host_cpu
from agent.kv_tier_moves import open_tier_store
from agent.kv_transfer import KVSender
from agent.memory_plan import refuse_what_cannot_fit
from agent.model.formats import load_checkpoint
from agent.service import AgentService, largest_frame_bytes
from config.logs import agent_log_filename, setup_logging
from config.schema import CurveSection, ServingConfig

POLL_MS = 200
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent-pid check in the loop still applies


def run_cluster_scheduler(config: ServingConfig, group: int, parent_pid: int) -> None:
    """multiprocessing target: MindSpore's cluster scheduler of a tensor-parallel group (the
    launcher set MS_ROLE=MS_SCHED and the address). init() serves the cluster until it is killed."""
    _die_with_parent()
    log = setup_logging(config.logging, f"cluster_{group}.log")
    from mindspore.communication import init

    log.info("group %d: cluster scheduler on port %s", group, os.environ.get("MS_SCHED_PORT"))
    init()


def run_agent(config: ServingConfig, rank: int, startup_queue, parent_pid: int) -> None:
    """multiprocessing target. Puts ("ready", rank, port, pid, warm-up s) or ("failed", rank, error)."""
    _die_with_parent()
    stopping = {"signal": None}

    def request_stop(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    port = config.agents.ports[rank]
    log = setup_logging(config.logging, agent_log_filename(rank))
    try:
        _pin_cpus(config, rank, log)
        socket, service, warm_up_s, authenticator = _start(config, rank, port, log)
    except Exception as exc:
        log.error("start-up failed: %s\n%s", exc, traceback.format_exc())
        startup_queue.put(("failed", rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    # The model, its graphs and MindSpore's objects live as long as the agent: out of the cyclic
    # collector's full passes, which would otherwise walk them all in the middle of a step.
    gc.freeze()
    startup_queue.put(("ready", rank, port, os.getpid(), warm_up_s))
    log.info("ready on %s", config.agents.address(rank))
    try:
        _serve(socket, service, config.agents.curve, stopping, parent_pid, log)
    finally:
        socket.close(linger=0)
        if service.sender is not None:
            service.sender.close()
        if service.tiers is not None:
            service.tiers.close()  # the queued disk writes first: they are the next run's hits
        if authenticator is not None:
            authenticator.stop()
        log.info("agent rank %d stopped", rank)


def _pin_cpus(config: ServingConfig, rank: int, log: logging.Logger) -> None:
    """Before any graph runs: MindSpore's workers and the kernels' thread team size themselves
    from the CPUs this process may use."""
    if config.agents.cpu_affinity is None:
        return
    cpus = config.agents.cpu_affinity[rank]
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise RuntimeError(
            f"cannot run agent rank {rank} on CPUs {cpus} (agents.cpu_affinity): "
            f"{exc.strerror}; this machine has CPUs {sorted(os.sched_getaffinity(0))}"
        ) from exc
    log.info("agent rank %d runs on CPUs %s", rank, cpus)


def _start(config: ServingConfig, rank: int, port: int, log: logging.Logger):
    place = Placement.of_agent(config, rank)
    log.info(
        "agent rank %d: device %s:%d, model %s",
        rank,
        config.runtime.device_target,
        place.device_id,
        config.model.path,
    )
    if config.runtime.device_target == "CPU":  # every performance figure says which machine made it
        kernel_target = kernels.target()
        log.info("CPU: %s", host_cpu.describe(kernel_target, kernels.target_macros(kernel_target)))
    if config.runtime.speculation.method == "draft" and place.cache_user is not None:
        # the compile cache is keyed by one model's weights and shapes (agent/compile_cache.py):
        # two models' graphs in one process would share a folder, so neither is cached
        log.info("compile cache off: the draft model's graphs run in this process beside the model's")
        place = replace(place, cache_user=None)
    tiers_config = config.runtime.kv_tiers
    if tiers_config.enabled and config.model.uses_mindir:
        raise RuntimeError("runtime.kv_tiers needs the model's weights (a checkpoint), not MindIR files")
    init_device(config, place, log.info)
    # the tier's files are named by the weights' fingerprint: the checkpoint is loaded here for it
    checkpoint = None
    if tiers_config.enabled:
        refuse_what_cannot_fit(Path(config.model.path), place.runtime(config.runtime))
        checkpoint = load_checkpoint(config.model.path, split=place.split, dtype=config.runtime.dtype)
    runner, warm_up_s = build_runner(config, place, log.info, checkpoint)
    tiers = None
    if checkpoint is not None:
        # blocks computed by other arithmetic (the kernels, int8 activations) would not equal a
        # recompute here: each arithmetic keeps a folder of its own
        runtime = runner.runtime
        attention = "paged" if runtime.paged_attention else "kernel" if runtime.attention_kernel else "gather"
        arithmetic = f"{runtime.activations}-{'kernel' if runtime.matmul_kernel else 'mindspore'}-{attention}"
        if runtime.kv_cache_dtype == "q8_0":  # its blocks are other bytes: a folder of their own
            arithmetic += "-q8_0"
        tiers = open_tier_store(
            runner,
            checkpoint,
            tiers_config.host_mb << 20,
            tiers_config.disk_mb << 20,
            tiers_config.disk_dir / arithmetic,
        )
        log.info(
            "KV tiers: host %d MB, disk %d MB%s, %d blocks held at start",
            tiers_config.host_mb,
            tiers_config.disk_mb,
            f" in {tiers.disk_dir}" if tiers.disk_dir is not None else "",
            len(tiers.keys()),
        )
        del checkpoint
    drafter = build_drafter(config, runner, log.info) if place.role != "prefill" else None
    socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, largest_frame_bytes(runner, place.role))
    agents = config.agents
    curve = agents.curve
    authenticator = None
    if curve is not None:
        # a decode agent also admits the prefill agents' keys, for kv_receive alone
        peers = (
            [r for r, role in enumerate(agents.roles) if role == "prefill"] if place.role == "decode" else []
        )
        authenticator = secure_agent_socket(socket, curve, rank, peers)
        log.info(
            "socket CURVE-encrypted: the server's key accepted, and %d prefill agents' for KV", len(peers)
        )
    else:
        log.info("socket not encrypted (loopback)")
    socket.bind(agents.address(rank))  # after warm-up: connecting means ready
    sender = (
        KVSender(_sender_keys(config, rank), agents.kv_transfer_timeout_s)
        if place.role == "prefill"
        else None
    )
    service = AgentService(
        runner,
        model_name=config.model.name,
        rank=rank,
        port=port,
        role=place.role,
        sender=sender,
        drafter=drafter,
        tiers=tiers,
    )
    log.info("role %s", place.role)
    return socket, service, warm_up_s, authenticator


def _sender_keys(config: ServingConfig, rank: int) -> dict[str, ClientKeys] | None:
    """A prefill agent's keys for each decode agent: its own keypair, that agent's public key."""
    agents = config.agents
    if agents.curve is None:
        return None
    own = agents.curve.own_agent_keypair(rank)
    return {
        agents.address(r): ClientKeys(*own, agent_public_key=agents.curve.agents[r].public_key)
        for r, role in enumerate(agents.roles)
        if role == "decode"
    }


def _serve(
    socket,
    service: AgentService,
    curve: CurveSection | None,
    stopping: dict,
    parent_pid: int,
    log: logging.Logger,
) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while stopping["signal"] is None:
        if os.getppid() != parent_pid:
            log.warning("launcher (pid %d) is gone; exiting", parent_pid)
            return
        try:
            ready = poller.poll(POLL_MS)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EINTR or stopping["signal"] is not None:
                continue
            raise
        if not ready:
            continue
        identity, *frames = socket.recv_multipart(copy=False)
        start = time.perf_counter()
        from_peer = curve is not None and is_peer(frames[0], curve)
        reply = service.handle([f.buffer for f in frames], from_peer=from_peer)
        socket.send_multipart([identity, *reply], copy=False)
        log.debug("request served in %.1f ms", (time.perf_counter() - start) * 1000)
        if service.shutdown_requested:
            log.info("shutdown requested over the wire")
            return
    log.info("stopping on signal %d", stopping["signal"])
