"""Horovod's launch spellings: `tfdist launch -np`, `tfdist horovodrun`, `tfdist.horovod.run`.

Parsing and the printed multi-host commands are checked without processes.
Local jobs run tests/workers/task.py (plain Python: quick); run() starts
plain-Python ranks from a script whose functions live in __main__, with
cloudpickle and with pickle.
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from tfdist.cli import commands as cli
from tfdist.engines import horovodrun
from tfdist.engines.horovodrun import HostSlots
from tfdist.errors import ConfigError

TASK = str(REPO / "tests" / "workers" / "task.py")
RUN_MAIN = str(REPO / "tests" / "workers" / "hvd_run_main.py")


def _tf_configs(text: str) -> list[tuple[dict, list[str]]]:
    """(TF_CONFIG, argv) of each command line that tfdist hosts prints."""
    out = []
    for line in text.splitlines():
        if line.startswith("TF_CONFIG="):
            words = shlex.split(line)
            out.append((json.loads(words[0].split("=", 1)[1]), words[1:]))
    return out


# ---------------------------------------------------------------- parsing


def test_hosts_fill_in_order_like_horovodrun():
    hosts = horovodrun.parse_hosts("node-a:2, node.b:3,node_c")
    assert hosts == [HostSlots("node-a", 2), HostSlots("node.b", 3), HostSlots("node_c", 1)]
    assert horovodrun.rank_hosts(4, hosts) == ["node-a", "node-a", "node.b", "node.b"]
    assert horovodrun.rank_hosts(6, hosts)[-1] == "node_c"
    assert horovodrun.rank_hosts(3, None) == ["localhost"] * 3
    assert horovodrun.is_local(
        horovodrun.rank_hosts(2, horovodrun.parse_hosts("localhost:1,127.0.0.1:1"))
    )
    assert not horovodrun.is_local(horovodrun.rank_hosts(3, hosts))


@pytest.mark.parametrize(
    "text, value",
    [
        ("a:x", "a:x"),
        ("a:0", "a:0"),
        (":2", ":2"),
        ("a:1:2", "a:1:2"),
        ("a b:1", "a b:1"),
        ("a:1,a:2", "a:1,a:2"),
        ("", ""),
        ("b:1,a:-1", "a:-1"),
    ],
)
def test_malformed_hosts_name_the_field_and_value(text, value):
    with pytest.raises(ConfigError) as info:
        horovodrun.parse_hosts(text)
    assert info.value.field == "hosts" and info.value.value == value
    assert f"Received: {value!r}" in str(info.value)


@pytest.mark.parametrize(
    "np, hosts, expected",
    [
        (0, None, "an integer >= 1"),
        (-2, "a:2", "an integer >= 1"),
        (True, None, ">= 1"),
        (5, "a:2,b:2", "at most 4, the slots of the hosts (a:2,b:2)"),
    ],
)
def test_np_outside_the_slots_is_refused(np, hosts, expected):
    parsed = None if hosts is None else horovodrun.parse_hosts(hosts)
    with pytest.raises(ConfigError) as info:
        horovodrun.rank_hosts(np, parsed)
    assert info.value.field == "np" and info.value.value is np
    assert expected in str(info.value) and f"Received: {np!r}" in str(info.value)


def test_hostfile_lines_and_errors(tmp_path):
    good = tmp_path / "hosts"
    good.write_text("# two nodes\nnode1 slots=2\n\n  node2   slots=1  # spare\nnode3\n")
    assert horovodrun.parse_hostfile(good) == [
        HostSlots("node1", 2),
        HostSlots("node2", 1),
        HostSlots("node3", 1),
    ]
    bad = tmp_path / "bad"
    bad.write_text("node1 slots=2\nnode2 slot=2\n")
    with pytest.raises(ConfigError) as info:
        horovodrun.parse_hostfile(bad)
    assert info.value.field == "hostfile" and ", line 2" in str(info.value)
    assert "'node2 slot=2'" in str(info.value)
    with pytest.raises(ConfigError, match="field 'hostfile'.*No such file"):
        horovodrun.parse_hostfile(tmp_path / "missing")
    with pytest.raises(ConfigError, match="not both"):
        horovodrun.read_hosts("a:1", good)


@pytest.mark.parametrize(
    "words, expected",
    [
        (["python", "train.py", "--lr", "1"], (None, ["train.py"], ["--lr", "1"])),
        (["python3", "-u", "train.py"], (None, ["-u", "train.py"], [])),
        (
            ["python3.11", "-W", "ignore", "-m", "pkg.train", "-m", "x"],
            (None, ["-W", "ignore", "-m", "pkg.train"], ["-m", "x"]),
        ),
        ([sys.executable, "-c", "print(1)", "a"], (None, ["-c", "print(1)"], ["a"])),
        (["/opt/venv/bin/python", "t.py"], ("/opt/venv/bin/python", ["t.py"], [])),
        (["train.py", "python"], (None, ["train.py"], ["python"])),
    ],
)
def test_a_leading_python_word_is_dropped(words, expected):
    assert horovodrun.split_python(words) == expected


@pytest.mark.parametrize("words", [[], ["python"], ["python", "-u"], ["python", "--foo", "t.py"]])
def test_a_command_without_a_script_is_refused(words):
    with pytest.raises(ConfigError) as info:
        horovodrun.split_python(words)
    assert info.value.field == "command"


# ---------------------------------------------------------------- the CLI


def test_horovodrun_with_other_hosts_prints_each_hosts_commands(capsys):
    code = cli.main(
        [
            "horovodrun",
            "-np",
            "3",
            "-H",
            "node1:2,node2:2",
            "python",
            "-u",
            "train.py",
            "--lr",
            "0.1",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2  # Nothing was started.
    assert "ranks run on 2 hosts (node1, node2)" in err and "Warning" not in err
    configs = _tf_configs(out)
    assert [c["task"] for c, _ in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert configs[0][0]["cluster"] == {"worker": ["node1:2222", "node1:2223", "node2:2222"]}
    assert all(argv == ["python", "-u", "train.py", "--lr", "0.1"] for _, argv in configs)
    assert out.index("# host node1: 2 tasks") < out.index("# host node2: 1 task")


def test_launch_takes_np_hosts_and_python_and_warns_about_localhost(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nnode2 slots=4\n")
    code = cli.main(
        [
            "launch",
            "-np",
            "2",
            "--hostfile",
            str(hostfile),
            "python",
            "-m",
            "pkg.train",
            "--epochs",
            "3",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2
    assert "'localhost' in a job with other hosts cannot be reached" in err
    configs = _tf_configs(out)
    assert [c["cluster"]["worker"] for c, _ in configs] == [["localhost:2222", "node2:2222"]] * 2
    assert configs[1][1] == ["python", "-m", "pkg.train", "--epochs", "3"]


@pytest.mark.parametrize(
    "argv, field, shown",
    [
        (["horovodrun", "-np", "5", "-H", "a:2,b:2", "python", "t.py"], "np", "Received: 5"),
        (["horovodrun", "-np", "0", "python", "t.py"], "np", "Received: 0"),
        (["horovodrun", "-np", "2", "-H", "a:two", "t.py"], "hosts", "Received: 'a:two'"),
        (["horovodrun", "-np", "2", "-p", "2222", "t.py"], "ssh_port", "never uses SSH"),
        (["horovodrun", "-np", "2", "--min-np", "1", "t.py"], "min_np", "--max-restarts"),
        (["horovodrun", "-np", "2", "python"], "command", "Received: 'python'"),
        (["horovodrun", "-np", "2", "--start-timeout", "0", "t.py"], "start_timeout", "> 0"),
        (["launch", "-np", "2", "-H", "localhost:2", "--chief", "t.py"], "chief", "Horovod-style"),
    ],
)
def test_bad_launch_input_names_the_field(capsys, argv, field, shown):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"field '{field}'" in err and shown in err


def test_launch_np_python_spelling_and_horovodrun_run_locally(capsys):
    # `tfdist launch -np 2 python SCRIPT` is `tfdist launch --workers 2 SCRIPT`.
    assert cli.main(["launch", "-np", "2", "python", TASK, "ok"]) == 0
    out = capsys.readouterr().out
    assert "[worker:0] task worker:0 of 2 workers, attempt 0" in out
    # All slots local: horovodrun launches here, every rank's output shown.
    assert (
        cli.main(
            [
                "horovodrun",
                "-np",
                "3",
                "-H",
                "localhost:2,127.0.0.1:2",
                "--max-restarts",
                "1",
                "python3",
                TASK,
                "fail-1-once",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "worker:1 exited with code 3; restart 1 of 1" in out
    for rank in range(3):
        assert f"[worker:{rank}] task worker:{rank} of 3 workers, attempt 1" in out


# ---------------------------------------------------------------- run()


def test_run_refuses_what_it_cannot_do(monkeypatch):
    # The module, not the function tfdist.horovod re-exports as `run`.
    run_module = importlib.import_module("tfdist.horovod.run")

    def ok():
        return 1

    cases = [
        (dict(np=2, hosts="node1:1,node2:1"), "hosts", "tfdist horovodrun"),
        (dict(np=0), "np", "Received: 0"),
        (dict(np=3, hosts="localhost:2"), "np", "at most 2"),
        (dict(num_proc="2"), "num_proc", "Received: '2'"),
        (dict(np=2, num_proc=3), "np", "the same as num_proc (3)"),
        (dict(np=2, min_np=1), "min_np", "fixed number"),
        (dict(use_gloo=True, use_mpi=True), "use_mpi", "use_gloo"),
        (dict(kwargs=[1]), "kwargs", "dict"),
        (dict(start_timeout=-1), "start_timeout", "> 0"),
    ]
    for kwargs, field, shown in cases:
        with pytest.raises(ConfigError) as info:
            run_module.run(ok, **kwargs)
        assert info.value.field == field and shown in str(info.value), kwargs
    monkeypatch.setattr(run_module, "_PICKLER", "pickle")
    with pytest.raises(ConfigError, match="field 'func'.*Install cloudpickle"):
        run_module.run(lambda: 1, np=1)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cloudpickle", "pickle"])
def test_run_calls_a_main_function_in_each_rank_restarts_and_raises_a_ranks_error(tmp_path, mode):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, RUN_MAIN, mode, str(out)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(out.read_text())
    assert seen["serializer"] == mode
    # Results by rank, from two processes that are not the caller.
    assert [s["rank"] for s in seen["seen"]] == [0, 10]
    assert all(s["workers"] == 2 for s in seen["seen"])
    pids = {s["pid"] for s in seen["seen"]}
    assert len(pids) == 2 and seen["parent_pid"] not in pids
    assert seen["types"] == ["Seen", "Seen"]
    # cloudpickle sends __main__'s function by value; pickle loads the
    # script as __mp_main__ in each rank.
    main_name = "__main__" if mode == "cloudpickle" else "__mp_main__"
    assert {s["tag"] for s in seen["seen"]} == {f"x-{main_name}"}
    error = seen["error"]
    assert error["type"] == "RunError" and error["rank"] == 1
    assert error["pickled_again"] == error["text"]
    assert error["error_type"] == "ValueError" and error["error_message"] == "rank 1 cannot go on"
    assert "rank 1 of 2 failed: ValueError: rank 1 cannot go on" in error["text"]
    assert "in fail_on_rank_1\n    raise ValueError" in error["text"]
    # After a restart the results are those of the attempt that finished.
    assert seen["restarted"] == [[0, 1], [1, 1]]
    # Rank 0 was sleeping: stopped, not left behind.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in seen["failing_pids"]):
        time.sleep(0.05)
    assert not [p for p in seen["failing_pids"] if _alive(p)]


@pytest.mark.slow
def test_run_ranks_call_hvd_init_and_allreduce(tmp_path):
    out = tmp_path / "out.json"
    script = REPO / "tests" / "workers" / "hvd_run_allreduce.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["local_size"] == 2 for r in results)
    assert [r["local_rank"] for r in results] == [0, 1]
    # What the ranks sent, summed and averaged here, against what each rank got.
    sent = [r["sent"] for r in results]
    assert sent[0] != sent[1]
    total = [a + b for a, b in zip(*sent)]
    for r in results:
        assert r["sum"] == pytest.approx(total)
        assert r["mean"] == pytest.approx([t / 2 for t in total])
