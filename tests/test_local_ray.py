"""A local Ray started by pagedserve has no API server (the dashboard being off), a minimal
dashboard agent, no autoscaler monitor, and no log monitor while it comes up; `serve` starts the
log monitor once it serves, and the workers' lines written before that still reach the driver.

Each case runs in its own interpreter: the test session's Ray is already initialised."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import sys, time
import psutil, ray
from workers.local_ray import init_local_ray, start_deferred_log_monitor

def daemons(script):
    return sum(1 for p in psutil.process_iter(["cmdline"])
               if any(part.endswith(script) for part in p.info["cmdline"] or [])
               and session in " ".join(p.info["cmdline"]))

init_local_ray(num_cpus=1, log_to_driver=LOG_TO_DRIVER)
session = ray._private.worker._global_node.get_session_dir_path()  # this cluster's, not another's

@ray.remote
class Talker:
    def say(self, text):
        print(text, flush=True)
        return True

talker = Talker.remote()
assert ray.get(talker.say.remote("written-before-the-monitor"))
# The runtime-env agent (its port picked before the raylet starts) still serves an actor's runtime_env.
@ray.remote
def env_var():
    import os
    return os.environ.get("PAGEDSERVE_LOCAL_RAY_TEST")
port = ray._private.worker._global_node.runtime_env_agent_port
with_env = env_var.options(runtime_env={"env_vars": {"PAGEDSERVE_LOCAL_RAY_TEST": "yes"}})
print("runtime env:", port > 0, ray.get(with_env.remote()), flush=True)
print("before:", daemons("log_monitor.py"), daemons("dashboard.py"), flush=True)
# (the agent sets its process title: its whole command line comes as one string)
agents = [line for line in (" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
          if "dashboard/agent.py" in line and session in line]
print("minimal agent:", len(agents) == 1 and " --minimal" in agents[0], flush=True)
print("autoscaler monitors:", daemons("autoscaler/_private/monitor.py"), flush=True)
if LOG_TO_DRIVER:
    print("started:", start_deferred_log_monitor(), flush=True)
    print("again:", start_deferred_log_monitor(), flush=True)  # one monitor, not two
    time.sleep(4)  # the monitor's first pass over the files and the driver's print
    print("after:", daemons("log_monitor.py"), daemons("dashboard.py"), flush=True)
ray.shutdown()
print("after shutdown:", daemons("log_monitor.py"), daemons("dashboard.py"), flush=True)
"""


# A Ctrl-C that lands inside an at-fork hook while the monitor starts: Python prints and drops an
# exception raised there, so an unheld SIGINT would be lost and `serve` would keep running.
CTRL_C_DURING_THE_START = r"""
import os, signal
import ray
from workers.local_ray import init_local_ray, start_deferred_log_monitor

init_local_ray(num_cpus=1, log_to_driver=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
sent = []
def interrupt_once():
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
os.register_at_fork(after_in_parent=interrupt_once)
try:
    start_deferred_log_monitor()
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    processes = ray._private.worker._global_node.all_processes
    print("interrupted after the start:", "log_monitor" in processes, flush=True)
print("handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
ray.shutdown()
"""


def _run(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_the_log_monitor_starts_late_and_what_workers_wrote_before_is_printed():
    out = _run(SCRIPT.replace("LOG_TO_DRIVER", "True"))
    assert "before: 0 0" in out
    assert "minimal agent: True" in out  # the raylet's dashboard agent without its servers
    assert "autoscaler monitors: 0" in out
    assert "runtime env: True yes" in out
    assert "started: True" in out and "again: False" in out
    assert "after: 1 0" in out  # the monitor; still no API server
    # The actor's line, written before the monitor existed, reached the driver through it.
    assert "written-before-the-monitor" in out.split("before:")[1], out[-3000:]
    assert "after shutdown: 0 0" in out


def test_a_driver_that_prints_no_worker_lines_runs_actors_without_either_daemon():
    out = _run(SCRIPT.replace("LOG_TO_DRIVER", "False"))
    assert "before: 0 0" in out and "after shutdown: 0 0" in out
    assert "written-before-the-monitor" not in out


def test_a_ctrl_c_while_the_log_monitor_starts_is_delivered_after_it_not_lost():
    out = _run(CTRL_C_DURING_THE_START)
    assert "interrupted after the start: True" in out, out[-3000:]
    assert "handler restored: True" in out
