"""Starting a local Ray cluster for pagedserve: every `ray.init` of a new cluster goes through here.

Three of the daemons Ray starts with a cluster are not needed to run actors, and on 2 cores they sit
on the critical path of `ray.init`:
- the API server (dashboard.py): with the dashboard off it loads one module, usage statistics
  (Ray's own comment: not even the job or state APIs), yet `ray.init` waits until it has imported
  and published its address, 1.3-1.6 s of a 3.4 s `ray.init` in a py-spy profile of one start,
  with ~1.1 CPU-s beside the raylet's own start. A cluster without the dashboard gets none.
- the log monitor, which tails the workers' log files and publishes their lines to the driver:
  `ray.init` took 2.81-2.89 s without it against 2.95-4.13 s with it (4 alternated starts each).
  `pagedserve serve`, whose terminal shows the workers' lines, starts it once it serves
  (`start_deferred_log_monitor`); it reads each log file from its beginning, so nothing written
  meanwhile is lost, only printed late. A driver that prints no worker lines
  (`log_to_driver=False`: the offline API with its ranks in Ray, benchmarks) never starts it.
- the autoscaler's monitor (monitor.py), which a cluster of one local node without an autoscaling
  config has no use for (it reports to `ray status` and the dashboard: a cluster started with the
  dashboard keeps it; `ray up` clusters start their own). Its 0.65 CPU-s of imports came beside
  the driver's connect: `ray.init` took 1.31-1.79 s without it against 2.19-2.55 s with it (3
  alternated starts each).

And one daemon starts in a lighter form: the raylet's dashboard agent (the raylet registers only
once it is up) runs minimal, as in a `pip install ray` without the dashboard's extras: without its
gRPC server (Ray's own metrics agent; pagedserve exports its own metrics) and its HTTP server
(which answers the API server, not started here). Ray decides the form by importing those extras
in the driver, 0.25 s of its CPU in a py-spy profile, before the raylet starts. Cached `serve` starts
took 6.10 and 6.25 s against 6.42 and 6.57 s (Ray up 2.94 against 3.15-3.18 s;
`cold_start.py --cached-starts 3`, alternated).

The raylet registers only once every agent has written the ports it picked (those it was given
as 0) to the session directory. The dashboard agent writes its last two (its HTTP port, -1 when
minimal, and Ray's metrics export port) after importing every dashboard module: 0.6 s after the
others, by the files' times. Those two are written for it before the raylet starts: -1 for both
(the agent still writes the real export port when it has it; only Ray's own metrics discovery
sees -1). `ray.init` took 1.91-1.99 s in three starts of four (2.82 in one) against 2.82-2.86 s,
alternated; cached `serve` starts 4.91 and 5.05 s against 5.90 and 5.85 s (Ray up 1.85 against
2.85 s; `cold_start.py`, alternated). Then the rest of the wait went too: the metrics agent's
port is written as -1 as well (what the minimal agent writes), and the runtime-env agent's port
is picked before the raylet starts (`Node._get_unused_port`, as Ray picks its own ports) and given
to both. The raylet then registered 0.02 s after it started, against 0.9-1.6 s. `ray.init`:
1.43-1.57 s in three starts of four (2.31 in one); cached `serve` starts (medians of 3) 4.50 and
5.29 s against 5.67 and 5.43 s, alternated (Ray up 0.77-0.81 s in four starts of six, 1.77-1.80 s
in two, against 1.79-2.88 s).

`ray.init` has no public switch for any of them (`ray start`'s `--include-log-monitor` and
`--no-monitor` are the CLI's). The hooks are its RayParams' `include_log_monitor` and `no_monitor`,
the head node's `start_api_server` and `start_raylet`, its `get_dashboard_dependency_error` and
`persist_port`; where a Ray version lacks them, its cluster starts as Ray starts it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import signal
import threading

from workers.priority import RAY_SYSTEM_CONFIG

log = logging.getLogger(__name__)


def init_local_ray(**init_kwargs) -> None:
    """`ray.init` of a new local cluster with pagedserve's system config, no log monitor (see
    `start_deferred_log_monitor`), and, the dashboard being off unless asked for, no API server
    and no autoscaler monitor."""
    import ray

    init_kwargs.setdefault("_system_config", RAY_SYSTEM_CONFIG)
    init_kwargs.setdefault("include_dashboard", False)
    dashboard_off = not init_kwargs["include_dashboard"]
    without_api_server = _no_api_server() if dashboard_off else contextlib.nullcontext()
    minimal_agent = _minimal_dashboard_agent() if dashboard_off else contextlib.nullcontext()
    with _no_monitors(autoscaler=dashboard_off), without_api_server, minimal_agent:
        ray.init(**init_kwargs)


def start_deferred_log_monitor() -> bool:
    """Start the log monitor of the cluster this process started with `init_local_ray`; False
    where there is none to start (a joined cluster, one that has its monitor)."""
    from ray._private import ray_constants, worker

    node = getattr(worker, "_global_node", None)
    if node is None or not getattr(node, "head", False) or not hasattr(node, "start_log_monitor"):
        return False
    if ray_constants.PROCESS_TYPE_LOG_MONITOR in node.all_processes:
        return False
    with _stop_signals_held():
        node.start_log_monitor()  # registered with the node's processes: ray.shutdown() ends it
    return True


@contextlib.contextmanager
def _stop_signals_held():
    """SIGINT and SIGTERM arriving inside the block are delivered when it ends. Ray starts its
    daemons with a preexec_fn, so Python runs its at-fork hooks, and an exception raised by a
    signal handler inside one of them is printed and dropped: a Ctrl-C there was lost and the
    server kept running (1 start in 6, stopped right after it printed "serving")."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers are the main thread's to set; its signals reach it as ever
        return
    held: list[int] = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda received, frame: held.append(received))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)  # now to the handler that was in place


@contextlib.contextmanager
def _no_monitors(autoscaler: bool):
    """No log monitor and, where `autoscaler`, no autoscaler monitor: RayParams'
    `include_log_monitor` and `no_monitor`, each where this Ray has it."""
    from ray._private.parameter import RayParams

    original = RayParams.__init__
    parameters = inspect.signature(original).parameters
    wanted = {"include_log_monitor": False, **({"no_monitor": True} if autoscaler else {})}
    defaults = {name: value for name, value in wanted.items() if name in parameters}
    for name in wanted:
        if name not in defaults:
            log.debug("this Ray's RayParams has no %s; that monitor starts with it", name)
    if not defaults:
        yield
        return

    def without_monitors(self, *args, **kwargs):
        for name, value in defaults.items():
            kwargs.setdefault(name, value)
        original(self, *args, **kwargs)

    RayParams.__init__ = without_monitors
    try:
        yield
    finally:
        RayParams.__init__ = original


@contextlib.contextmanager
def _minimal_dashboard_agent():
    """The raylet's dashboard agent in its minimal form, as a `pip install ray` without the
    dashboard's extras runs it: Ray picks the form by importing those extras in the driver. The
    raylet is told beforehand the ports it would wait for the agents to publish
    (`_tell_agent_ports`), so that it registers without waiting on them."""
    from ray._private import utils
    from ray._private.node import Node

    original = getattr(utils, "get_dashboard_dependency_error", None)
    if original is None:
        yield
        return
    utils.get_dashboard_dependency_error = lambda: ImportError("pagedserve: the dashboard is off")
    start_raylet = Node.start_raylet

    def start_raylet_told(self, *args, **kwargs):
        _tell_agent_ports(self)
        return start_raylet(self, *args, **kwargs)

    Node.start_raylet = start_raylet_told
    try:
        yield
    finally:
        utils.get_dashboard_dependency_error = original
        Node.start_raylet = start_raylet


def _tell_agent_ports(node) -> None:
    """The port files the raylet waits for before it registers: the minimal dashboard agent's
    (its HTTP and gRPC ports, none, -1, in its minimal form; Ray's metrics export port, -1 until
    the agent writes the real one), and the runtime-env agent's, whose port is chosen here
    instead of by the agent, so that the raylet has it from its command line."""
    try:
        from ray._raylet import (DASHBOARD_AGENT_LISTEN_PORT_NAME, METRICS_AGENT_PORT_NAME,
                                 METRICS_EXPORT_PORT_NAME, persist_port)

        for name in (DASHBOARD_AGENT_LISTEN_PORT_NAME, METRICS_EXPORT_PORT_NAME, METRICS_AGENT_PORT_NAME):
            persist_port(node.get_session_dir_path(), node._node_id, name, -1)
        if not node._ray_params.runtime_env_agent_port:  # 0: the agent would pick it, the raylet wait
            node._ray_params.runtime_env_agent_port = node._get_unused_port()  # as Ray picks its own
    except Exception as e:  # another Ray's internals: its raylet then waits as it always did
        log.debug("could not tell the raylet the agent's ports ahead: %r", e)


@contextlib.contextmanager
def _no_api_server():
    from ray._private.node import Node

    original = Node.__dict__.get("start_api_server")
    if original is None:
        yield
        return
    Node.start_api_server = lambda self, **kwargs: None  # leaves the node's webui_url None
    try:
        yield
    finally:
        Node.start_api_server = original
