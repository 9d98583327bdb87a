"""One agent process: load, warm up, bind a ROUTER socket, report ready, serve until told to stop.

Started by the launcher (agent/launcher.py) through multiprocessing's spawn context. Stops on SIGTERM
or SIGINT (after the step in flight: the handler only sets a flag), on a `shutdown` request, or by
itself when its parent dies (PR_SET_PDEATHSIG, and a parent-pid check for non-Linux or races).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
import traceback

import zmq

from agent.model.formats import load_checkpoint
from agent.compile_cache import compile_cache_dir
from agent.known_answer import KnownAnswer, KnownAnswerError
from agent.kv_transfer import KVSender
from agent.llama_graphs import TensorSplit
from agent.memory_plan import resolve_runtime
from agent.mindir import read_known_answer, read_spec
from agent.runner import ModelRunner, configure_mindspore
from agent.service import AgentService
from agent.contract.transport import secure_agent_socket
from config.logs import setup_logging
from config.schema import ServingConfig

POLL_MS = 200
PR_SET_PDEATHSIG = 1


def log_filename(rank: int) -> str:
    return f"agent_{rank}.log"


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
    log = setup_logging(config.logging, log_filename(rank))
    try:
        _pin_cpus(config, rank, log)
        socket, service, warm_up_s, authenticator = _start(config, rank, port, log)
    except Exception as exc:
        log.error("start-up failed: %s\n%s", exc, traceback.format_exc())
        startup_queue.put(("failed", rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    startup_queue.put(("ready", rank, port, os.getpid(), warm_up_s))
    log.info("ready on %s", config.agents.address(rank))
    try:
        _serve(socket, service, stopping, parent_pid, log)
    finally:
        socket.close(linger=0)
        if service.sender is not None:
            service.sender.close()
        if authenticator is not None:
            authenticator.stop()
        log.info("agent rank %d stopped", rank)


def _pin_cpus(config: ServingConfig, rank: int, log: logging.Logger) -> None:
    """Before any graph runs: MindSpore's workers and the kernels' OpenMP team size themselves
    from the CPUs this process may use."""
    if config.agents.cpu_affinity is None:
        return
    cpus = config.agents.cpu_affinity[rank]
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise RuntimeError(f"cannot run agent rank {rank} on CPUs {cpus} (agents.cpu_affinity): "
                           f"{exc.strerror}; this machine has CPUs {sorted(os.sched_getaffinity(0))}") from exc
    log.info("agent rank %d runs on CPUs %s", rank, cpus)


def _start(config: ServingConfig, rank: int, port: int, log: logging.Logger):
    runtime = config.runtime
    slots = config.agents.group(rank).num_slots
    if slots is not None:
        runtime = runtime.model_copy(update={"num_slots": slots})
    device_id = config.agents.start_device_id + rank
    log.info("agent rank %d: device %s:%d, model %s", rank, runtime.device_target, device_id,
             config.model.path)
    role = config.agents.roles[rank]
    start = time.perf_counter()
    if config.model.uses_mindir:
        runtime = resolve_runtime(read_spec(config.model), runtime, log.info)
        configure_mindspore(runtime, device_id)
        runner = ModelRunner.from_mindir(config.model, runtime)
        log.info("MindIR graphs loaded in %.1fs (%.1fM parameters)", time.perf_counter() - start,
                 runner.spec.parameter_count() / 1e6)
        known, cache = read_known_answer(config.model), None
    else:
        checkpoint = load_checkpoint(config.model.path)
        log.info("weights loaded in %.1fs (%s, %.1fM parameters)", time.perf_counter() - start,
                 checkpoint.format, checkpoint.spec.parameter_count() / 1e6)
        runtime = resolve_runtime(checkpoint.spec, runtime, log.info)
        split = TensorSplit(config.agents.rank_in_group[rank], config.agents.group(rank).tensor_parallel)
        cache_user = f"rank_{rank}" + (f"_tp{split.rank}of{split.size}" if split.size > 1 else "")
        cache = compile_cache_dir(checkpoint, runtime, cache_user)
        configure_mindspore(runtime, device_id, cache)
        if split.size > 1:
            _join_cluster(split, checkpoint.spec, log)
        runner = ModelRunner(checkpoint, runtime, split)
        t0 = time.perf_counter()
        known = KnownAnswer.of_checkpoint(checkpoint, runtime)
        log.info("known answer for the warm-up check computed in %.2fs", time.perf_counter() - t0)
    log.info("KV cache: %d slots x %d positions, %.0f MB", runtime.num_slots, runtime.max_seq_len,
             runner.graphs.cache_bytes() / 1e6)
    try:
        warm_up_s = runner.warm_up(log.info, role, known)
    except KnownAnswerError as exc:
        where = (f"the compile cache {cache.parent} holds graphs that do not fit this model: delete that "
                 f"folder and start again (if this persists with an empty cache, it is a bug: report it)"
                 if cache is not None else
                 f"the MindIR files of {config.model.path} do not fit their own manifest: export them again"
                 if config.model.uses_mindir else "no cache was used: this is a bug, please report it")
        raise KnownAnswerError(f"{exc}; {where}") from exc
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    curve = config.agents.curve
    authenticator = secure_agent_socket(socket, curve) if curve is not None else None
    socket.bind(config.agents.address(rank))  # after warm-up: connecting means ready
    log.info("socket %s", "CURVE-encrypted, only the configured server key accepted"
             if curve is not None else "not encrypted (loopback)")
    sender = (KVSender(curve, config.agents.kv_transfer_timeout_s) if role == "prefill" else None)
    service = AgentService(runner, model_name=config.model.name, rank=rank, port=port, role=role,
                           sender=sender)
    log.info("role %s", role)
    return socket, service, warm_up_s, authenticator


def _join_cluster(split: TensorSplit, spec, log: logging.Logger) -> None:
    """Tensor parallelism: join the group's MindSpore cluster (the launcher set MS_ROLE=MS_WORKER,
    MS_NODE_ID and the scheduler's address); its collectives then run inside the graphs."""
    from mindspore.communication import get_group_size, get_rank, init

    if spec.num_kv_heads < split.size:
        raise RuntimeError(f"{spec.num_kv_heads} KV heads cannot be split over {split.size} agents")
    log.info("joining the tensor-parallel cluster as rank %d of %d (scheduler %s:%s)", split.rank,
             split.size, os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT"))
    init()
    if (get_rank(), get_group_size()) != (split.rank, split.size):
        raise RuntimeError(f"the cluster made this agent rank {get_rank()} of {get_group_size()}, "
                           f"the config rank {split.rank} of {split.size}")
    start, end = split.share(spec.num_kv_heads)
    log.info("tensor-parallel rank %d of %d: KV heads %d..%d, FFN columns %s", split.rank, split.size,
             start, end - 1, split.share(spec.intermediate_size))


def _serve(socket, service: AgentService, stopping: dict, parent_pid: int,
           log: logging.Logger) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while stopping["signal"] is None:
        if os.getppid() != parent_pid:
            log.warning("launcher (pid %d) is gone; exiting", parent_pid)
            return
        try:
            ready = poller.poll(POLL_MS)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EINTR or stopping["signal"] is not None:
                continue
            raise
        if not ready:
            continue
        identity, *frames = socket.recv_multipart(copy=False)
        start = time.perf_counter()
        reply = service.handle([f.buffer for f in frames])
        socket.send_multipart([identity, *reply], copy=False)
        log.debug("request served in %.1f ms", (time.perf_counter() - start) * 1000)
        if service.shutdown_requested:
            log.info("shutdown requested over the wire")
            return
    log.info("stopping on signal %d", stopping["signal"])
