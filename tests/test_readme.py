"""The README's first two commands: the main job and the test command."""

from __future__ import annotations

import re
import shlex

from conftest import REPO, finish, result_line, start


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, re.S)


def test_ci_runs_the_readmes_test_command():
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci_lines = (REPO / ".ci/run").read_text().splitlines()
    assert test_command in ci_lines


def test_readmes_main_job_trains_on_two_replicas():
    first = readme_commands()[0]
    install, _, job = first.partition(" && ")
    assert install.startswith("pip install")
    argv = shlex.split(job)
    assert argv[0] == "python"
    [(code, out, err)] = finish([start(argv[1:])], timeout=240)
    assert code == 0, err[-3000:]
    assert "MirroredStrategy (mirrored): 2 replica(s) in sync" in out
    assert "why: " in out
    result = result_line(out)
    assert result["replicas"] == 2 and len(result["loss"]) == 3
    assert result["loss"][-1] < 0.5 * result["loss"][0]


def test_readmes_links_name_files_of_the_repository():
    text = (REPO / "README.md").read_text()
    links = [
        link
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        if not link.startswith(("http://", "https://"))
    ]
    assert len(links) > 10  # The feature table links its pages.
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, missing


def test_readme_stays_short_and_the_docs_hold_the_rest():
    # The README is the front page (issue 31: about 250 lines at most); the
    # documentation is docs/, which tests/test_docs.py builds.
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
