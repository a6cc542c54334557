"""The warm pool (tfdist/engines/warm.py): jobs forked from a server that
imported TensorFlow, run as ``python`` runs them, and fail alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from tfdist.engines import warm

#: A job that reports what it started with.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    preloaded = "tensorflow" in sys.modules
    print(json.dumps({
        "preloaded": preloaded, "argv": sys.argv, "cwd": os.getcwd(),
        "value": os.environ.get("PROBE_VALUE"), "path0": sys.path[0],
        "ppid": os.getppid(), "stdin": sys.stdin.read(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
    """
)


@pytest.fixture(scope="module")
def pool():
    """A pool of this module's own: some tests kill its server."""
    with warm.WarmPool(env=subprocess_env()) as pool:
        pool.wait_ready()
        yield pool


def run(pool, args, *, env=None, **kwargs):
    return subprocess.run(
        [pool.python, *args],
        env={**subprocess_env(**(env or {})), **pool.env},
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def test_a_job_runs_as_python_runs_it(pool, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = run(
        pool,
        [str(script), "a", "b c"],
        env={"PROBE_VALUE": "v", "PROBE_CODE": "3"},
        cwd=REPO,
        input="from stdin",
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr == "to stderr\n"
    seen = json.loads(done.stdout)
    assert seen["preloaded"] is True  # Forked after the import.
    assert seen["ppid"] == pool.proc.pid  # The server's child, not the client's.
    assert seen["argv"] == [str(script), "a", "b c"]
    assert seen["cwd"] == str(REPO)
    assert seen["path0"] == str(tmp_path)
    assert seen["value"] == "v" and seen["stdin"] == "from stdin"


def test_module_and_code_forms(pool, tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    done = run(pool, ["-m", "probe_module", "x"], env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == [str(tmp_path / "probe_module.py"), "x"]
    assert seen["preloaded"] and seen["path0"] == str(tmp_path)
    # The code runs as __main__ (pickle, multiprocessing and Ray look for it there).
    code = "import sys; print(sys.argv, 'keras' in sys.modules, sys.modules['__main__'].sys is sys)"
    done = run(pool, ["-u", "-c", code, "y"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['-c', 'y'] True True\n"


def test_a_job_imports_tfdist_in_its_own_order(pool):
    # The server imported TensorFlow and Keras only: tfdist's import hook on
    # Keras is installed by the jobs that import tfdist, as in a fresh process.
    wrapped = "hasattr(keras.distribution.set_distribution, '__wrapped__')"
    stock = f"import sys, keras; print('tfdist' in sys.modules, {wrapped})"
    done = run(pool, ["-c", stock])
    assert (done.returncode, done.stdout) == (0, "False False\n"), done.stderr
    ours = (
        "import tfdist, keras; print(hasattr(keras.distribution.set_distribution, '__wrapped__'))"
    )
    done = run(pool, ["-c", ours])
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr


@pytest.mark.parametrize(
    ("code", "returncode", "stderr"),
    [
        ("raise ValueError('bad value')", 1, "ValueError: bad value"),
        ("import sys; sys.exit('a message')", 1, "a message"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -signal.SIGSEGV, ""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
        ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_a_job_ends_as_the_interpreter_would(pool, code, returncode, stderr):
    done = run(pool, ["-c", code])
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == fresh.returncode == returncode
    assert stderr in done.stderr and stderr in fresh.stderr


def test_a_job_exits_with_what_the_interpreters_exit_does(pool, tmp_path):
    # The pool skips the interpreter's teardown (warm_server._exit), not what
    # comes before it: non-daemon threads finish, atexit functions run, and a
    # file the job left open is flushed. The same code runs fresh beside it.
    code = textwrap.dedent(
        """
        import atexit, sys, threading, time
        out = sys.argv[1]
        left_open = open(out + ".open", "w")
        left_open.write("flushed at exit")
        def late():
            time.sleep(0.3)
            open(out + ".thread", "w").write("the thread finished")
        threading.Thread(target=late).start()
        atexit.register(lambda: open(out + ".atexit", "w").write("atexit ran"))
        print("unflushed", end="")
        sys.stdout.write(" stdout")
        """
    )
    results = {}
    for name, python, env in (
        ("pool", pool.python, pool.env),
        ("fresh", sys.executable, {}),
    ):
        out = tmp_path / name
        done = subprocess.run(
            [python, "-c", code, str(out)],
            env={**subprocess_env(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        results[name] = (
            done.returncode,
            done.stdout,
            *(Path(f"{out}.{part}").read_text() for part in ("open", "thread", "atexit")),
        )
    assert results["pool"] == results["fresh"]
    assert results["pool"][0] == 0 and results["pool"][1] == "unflushed stdout"


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold within the timeout"
        time.sleep(0.05)


def _state(pid: int) -> str:
    """The process's state letter (R, S, T, Z...), or "" once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0]
    except FileNotFoundError:
        return ""


def _where(*pids: int) -> str:
    """Each process's state and where each of its threads waits (for a hang)."""
    found = []
    for pid in pids:
        try:
            threads = sorted(os.listdir(f"/proc/{pid}/task"))
            waits = [Path(f"/proc/{pid}/task/{t}/wchan").read_text() for t in threads]
        except OSError:
            found.append(f"{pid}: gone")
            continue
        found.append(f"{pid}: state {_state(pid)}, threads waiting in {waits}")
    return "; ".join(found)


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z")


def test_signals_reach_the_job_and_its_children(pool, tmp_path):
    # As tfdist launch starts a task: in a session of its own, then stopped
    # with a signal to the group. The job's handler runs; its child goes too.
    code = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(tmp_path / "child")!r}, "w").write(str(child.pid))
        def stop(signum, frame):
            print("got", signum, flush=True)
            child.wait()
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        print("ready", os.getpid(), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [pool.python, "-c", code],
        env={**subprocess_env(), **pool.env},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready, job = proc.stdout.readline().split()
    assert ready == "ready"
    child = int((tmp_path / "child").read_text())
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 7
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end within 60 s of SIGTERM: {_where(int(job), child)}")
    assert proc.stdout.read() == f"got {signal.SIGTERM.value}\n"
    _wait_for(lambda: not _alive(child))


@contextlib.contextmanager
def _played_pool(tmp_path, **popen):
    """A pool played by the test: a client started on its socket (running
    ``python -c pass``), and the connection it opened, its request read.
    Yields ``(client, conn)``; kills the client if it still runs."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "socket"))
    listener.listen(1)
    client = subprocess.Popen(
        [
            sys.executable,
            "-S",
            str(Path(warm.__file__).parent / "worker" / "warm_client.py"),
            "-c",
            "pass",
        ],
        env={**subprocess_env(), warm.ENV: str(tmp_path)},
        **popen,
    )
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()
        conn.settimeout(60)
        assert json.loads(conn.recv(1 << 20)[4:])["client"] == client.pid
        yield client, conn
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        listener.close()


def _answer(**message) -> bytes:
    return json.dumps(message).encode() + b"\n"


def test_a_signal_before_the_pool_answers_reaches_the_job(tmp_path):
    # tfdist launch may stop its tasks just after starting them: the client
    # must not die of a SIGTERM that comes before it knows the job's pid (it
    # did, and the job ran on unsignalled). A pool played here holds the
    # answer back until the signal was sent.
    job = subprocess.Popen(["sleep", "600"])  # Stands for the forked process.
    try:
        with _played_pool(tmp_path) as (client, conn):
            client.send_signal(signal.SIGTERM)
            _wait_for(
                lambda: _signal_pending(client.pid, signal.SIGTERM) or client.poll() is not None
            )
            conn.sendall(_answer(pid=job.pid))
            try:
                assert job.wait(timeout=30) == -signal.SIGTERM
            except subprocess.TimeoutExpired:
                pytest.fail(
                    "the SIGTERM sent before the pool answered never reached the job "
                    f"(the client's exit: {client.poll()})"
                )
            conn.sendall(_answer(exit=job.returncode))
            assert client.wait(timeout=30) == -signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_signal_after_the_job_exited_leaves_its_exit_code(tmp_path):
    # tfdist launch resends SIGTERM every 2 s to tasks that wrote no status
    # record (tests/engines/test_preempt_launch.py's "ignore" tasks). One
    # that came while the client's interpreter finalized, which puts back
    # the default action, killed it after its job exited 0: the launcher
    # reported "worker:1 was killed by SIGTERM". A pool played here reports
    # the exit while the test sends SIGTERM without pause until the client
    # is gone; without the fix the client died of it in 5 runs of 6.
    job = subprocess.Popen(["true"])  # Stands for the forked process.
    job.wait()
    with _played_pool(tmp_path) as (client, conn):
        conn.sendall(_answer(pid=job.pid))
        _wait_for(lambda: _handles(client.pid, signal.SIGTERM))
        conn.sendall(_answer(exit=0))
        sent = 0
        while client.poll() is None and sent < 10**6:
            # A zombie takes signals too (ESRCH only once reaped).
            os.kill(client.pid, signal.SIGTERM)
            sent += 1
        assert client.wait(timeout=30) == 0, f"{sent} SIGTERMs sent"


@pytest.mark.parametrize("code", [0, 3, -signal.SIGKILL])
def test_a_job_that_ends_at_once_leaves_its_exit_code(tmp_path, code):
    # A job that exits before its client read the pid: the pool's two
    # answers came in one read, and the client died of a JSONDecodeError
    # ("Extra data"), exit 1 (tfdist launch's evaluator test saw it in a
    # full run). A pool played here sends both in one write.
    job = subprocess.Popen(["true"])  # Stands for the forked process.
    job.wait()
    with _played_pool(tmp_path, stderr=subprocess.PIPE, text=True) as (client, conn):
        conn.sendall(_answer(pid=job.pid) + _answer(exit=code))
        _, err = client.communicate(timeout=30)
        assert client.returncode == code, err


def _handles(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    [caught] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def _signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits, blocked, in the process's pending set."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    pending = [
        line.split()[1] for line in status.splitlines() if line.startswith(("ShdPnd", "SigPnd"))
    ]
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in pending)


def test_a_killed_client_takes_even_a_stopped_job_along(pool, tmp_path):
    # A hung peer (tests/workers/watchdog_job.py stops itself): the job cannot
    # run its own watch, so the server kills its group.
    code = "import os, signal; print(os.getpid(), flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    proc = subprocess.Popen(
        [pool.python, "-c", code],
        env={**subprocess_env(), **pool.env},
        stdout=subprocess.PIPE,
        text=True,
    )
    job = int(proc.stdout.readline())
    _wait_for(lambda: _state(job) == "T")
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _wait_for(lambda: not _alive(job))
    assert proc.stdout.read() == ""  # Nothing holds the pipe open.


def test_a_stopped_client_stops_its_job_until_it_continues(pool, tmp_path):
    # A test plays a hung peer with SIGSTOP, which cannot be caught and passed on.
    beats = tmp_path / "beats"
    code = textwrap.dedent(
        f"""
        import os, time
        print(os.getpid(), flush=True)
        for beat in range(400):
            with open({str(beats)!r}, "a") as f:
                f.write("x")
            time.sleep(0.01)
        """
    )
    proc = subprocess.Popen(
        [pool.python, "-c", code], env={**subprocess_env(), **pool.env}, stdout=subprocess.PIPE
    )
    job = int(proc.stdout.readline())
    _wait_for(lambda: beats.exists())
    proc.send_signal(signal.SIGSTOP)
    _wait_for(lambda: _state(job) == "T")
    count = beats.stat().st_size
    time.sleep(0.5)
    assert beats.stat().st_size == count  # No beat while stopped.
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=60) == 0
    assert beats.stat().st_size == 400


def test_what_a_job_leaves_in_its_group_ends_with_it(pool, tmp_path):
    # As a launcher's stop of a task's group would end it.
    code = (
        "import subprocess, sys; "
        "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).pid)"
    )
    done = run(pool, ["-c", code])
    assert done.returncode == 0, done.stderr
    _wait_for(lambda: not _alive(int(done.stdout)))


def test_no_job_sees_another_jobs_state(pool):
    # The first job splits its CPU, runs a collective, sets module state and
    # draws from NumPy's global generator; the second starts clean.
    first = textwrap.dedent(
        """
        import keras, numpy as np, tensorflow as tf, tfdist
        cpu = tf.config.list_physical_devices("CPU")[0]
        halves = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, halves)
        strategy = tfdist.strategy_from_config(cpu_replicas=2)
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        keras.left_by_the_first_job = True
        print(float(total), len(tf.config.list_logical_devices("CPU")), np.random.rand())
        """
    )
    second = textwrap.dedent(
        """
        import keras, numpy as np, tensorflow as tf, tfdist
        print(hasattr(keras, "left_by_the_first_job"),
              len(tf.config.list_logical_devices("CPU")), np.random.rand())
        """
    )
    one, two = run(pool, ["-c", first]), run(pool, ["-c", second])
    assert one.returncode == two.returncode == 0, one.stderr[-3000:] + two.stderr[-3000:]
    total, devices, draw_one = one.stdout.split()
    leaked, devices_two, draw_two = two.stdout.split()
    assert (float(total), int(devices)) == (2.0, 2)
    assert (leaked, int(devices_two)) == ("False", 1)
    assert draw_one != draw_two


PRELOADED = "import sys; print('tensorflow' in sys.modules)"


@pytest.mark.parametrize(
    ("args", "env", "why"),
    [
        (["-X", "dev", "-c", PRELOADED], {}, "option '-X'"),
        (["-u", "-"], {}, "option '-'"),  # The script on stdin.
        (["-c", PRELOADED], {"TF_CPP_MIN_LOG_LEVEL": "0"}, "TF_CPP_MIN_LOG_LEVEL"),
    ],
)
def test_a_job_the_pool_cannot_fork_runs_fresh(pool, args, env, why):
    done = run(pool, args, env=env, input=PRELOADED)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"  # A fresh interpreter: nothing imported.
    assert why in pool.log().splitlines()[-1]


def test_a_job_in_another_network_namespace_runs_fresh_in_it(pool):
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -n (root)")
    code = (
        "import socket, sys; "
        "print('tensorflow' in sys.modules, [n for _, n in socket.if_nameindex()])"
    )
    done = subprocess.run(
        ["unshare", "-n", pool.python, "-c", code],
        env={**subprocess_env(), **pool.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False ['lo']\n"
    assert "another context: ns:net" in pool.log().splitlines()[-1]


def test_a_dead_server_is_replaced(pool):
    starts = pool.starts
    pool.proc.kill()
    pool.proc.wait()
    # Until it is replaced, jobs run fresh.
    done = run(pool, ["-c", "import sys; print('tensorflow' in sys.modules)"])
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
    pool.ensure()
    pool.wait_ready()
    assert pool.starts == starts + 1
    done = run(pool, ["-c", "import sys; print('tensorflow' in sys.modules)"])
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr


def test_tfdist_launch_forks_its_tasks_from_the_pool_it_is_given(pool, tmp_path):
    from tfdist.engines import launch

    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        result = launch.launch(
            ["-c", "import sys; print('forked', 'tensorflow' in sys.modules)"],
            workers=2,
            show_all=True,
            env=pool.env,
            output=stream,
            handle_signals=False,
        )
    assert result.exit_code == 0, out.read_text()
    lines = sorted(line for line in out.read_text().splitlines() if "forked" in line)
    assert lines == ["[worker:0] forked True", "[worker:1] forked True"]
