"""`python -m ggufspec.llama_server`, replaced by `ggufspec serve`: one line naming the command that does the same."""

import subprocess
import sys

from clirun import TIMEOUT


def test_the_old_server_says_which_serve_command_replaces_it():
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server", "--model", "t.gguf", "--draft_model", "d.gguf",
                        "--port", "8000", "--n_ctx=2048", "--chat_format", "chatml"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("ggufspec serve -m t.gguf -md d.gguf --port 8000 -c 2048"), lines
