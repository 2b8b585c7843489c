"""The README's promises, checked as a new user meets them: its two commands run as written in a clean
shell (no PATH but the system's), minfer importable from outside the checkout afterwards, and its
"use it from Python" example run as it stands."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COMMAND_PREFIX = "./setup.sh && "  # .ci/run selects the README's commands by the same prefix
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
# The inner pytest run gets this static check only: no recursion into the commands test, no second suite.
INNER_TESTS = "tests/test_readme.py::test_readme_holds_the_two_commands_in_one_block -p no:cacheprovider"
SETUP_TIMEOUT_S = 1800  # a first sync into a new .venv links several GB from uv's cache


def fenced_blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language`, in order, without their fences."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.M | re.S)


def readme_commands() -> list[str]:
    return [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith(COMMAND_PREFIX)]

# CA bundles and proxies (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, HTTPS_PROXY, ...), and uv's cache.
MACHINE_NETWORK_SETTINGS = re.compile(r"SSL_CERT_(FILE|DIR)|[A-Z_]*CA_BUNDLE|(HTTPS?|NO|ALL)_PROXY|(https?|no|all)_proxy"
                                      r"|UV_CACHE_DIR")


def clean_shell(command: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """`command` in bash with only HOME, the system PATH and `env` set, like `env -i`. What the machine
    itself configures for reaching a package index passes through (its CA certificates and proxies: a
    rebuild of the editable install fetches setuptools), and so does uv's cache location when the
    caller moved it, so a test run links what is cached."""
    environment = {"HOME": str(Path.home()), "PATH": CLEAN_PATH, **env}
    environment |= {name: value for name, value in os.environ.items() if MACHINE_NETWORK_SETTINGS.fullmatch(name)}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=SETUP_TIMEOUT_S)


def test_readme_holds_the_two_commands_in_one_block():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert "\n".join(commands) + "\n" in fenced_blocks("bash"), "the two commands must form one fenced block"
    assert commands[0].endswith(" apps/generate.py") and commands[1].endswith(" pytest"), commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "grep '^\\./setup\\.sh && ' README.md" in ci, ".ci/run must run the README's lines as they are"
    assert not re.search(r"\bPATH\s*=", ci), ".ci/run must leave PATH as CI has it"


def test_readme_commands_in_a_clean_shell(tmp_path):
    if not (ROOT / ".venv").is_dir():
        pytest.skip("no .venv: run ./setup.sh first (CI does; the GPU machine, without uv or a package index, "
                    "cannot); this test reruns the commands in a clean shell against the environment it made")
    generate, run_tests = readme_commands()

    demo = clean_shell(generate)
    assert demo.returncode == 0, demo.stderr[-3000:]
    direct = subprocess.run([sys.executable, str(ROOT / "apps" / "generate.py")], cwd=ROOT, capture_output=True,
                            text=True, timeout=SETUP_TIMEOUT_S)
    assert direct.returncode == 0, direct.stderr[-3000:]
    assert demo.stdout.strip() and demo.stdout == direct.stdout, "the README command must print the demo's text"

    inner = clean_shell(run_tests, PYTEST_ADDOPTS=INNER_TESTS)
    assert inner.returncode == 0, inner.stdout[-3000:] + inner.stderr[-3000:]
    assert re.search(r"\b1 passed\b", inner.stdout), inner.stdout[-3000:]

    # setup.sh installed minfer into the project's environment: it imports from any folder
    venv_python = ROOT / ".venv" / "bin" / "python"
    elsewhere = clean_shell(f"'{venv_python}' -c 'import minfer; print(minfer.__file__)'", cwd=tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert Path(elsewhere.stdout.strip()) == ROOT / "minfer" / "__init__.py"


def test_readme_python_example_runs_on_the_cpu(tmp_path):
    (example,) = fenced_blocks("python")
    environment = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.fullmatch(r"(.|\n)+\n\d+ tokens at \d+\.\d tok/s\n", result.stdout), result.stdout
