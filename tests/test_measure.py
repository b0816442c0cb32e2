"""The cost cache (llama/measure.py): damaged entries measured again, what doctor shows of it, no temporary file
left by a full disk."""

import errno
import json
import os
import time
from pathlib import Path

import pytest

from clirun import run


@pytest.mark.parametrize("damage", ["a string", "missing key", "list", "zeros", "null exact"])
def test_a_damaged_cost_entry_is_measured_again_and_doctor_names_the_file(tiny, damage):
    from ggufspec.paths import costs_file

    assert run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    cache = json.loads(costs_file().read_text())
    for key in list(cache):
        if damage == "a string":
            cache[key] = "oops"
        elif damage == "missing key":
            cache[key] = {k: v for k, v in cache[key].items() if k not in ("exact_batch", "token_seconds")}
        elif damage == "list":
            cache[key] = []
        elif damage == "zeros":
            cache[key] = {**cache[key], "target_batch_seconds": [0.0] * 9, "token_seconds": 0}
        else:
            cache[key] = {**cache[key], "exact_batch": None, "token_seconds": None}
    costs_file().write_text(json.dumps(cache))
    doctor = run("doctor")
    assert str(costs_file()) in doctor.output and "damaged entr" in doctor.output
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4, "--mode", "auto")
    assert r.exit_code == 0, r.output
    assert "damaged entr" not in run("doctor").output  # measured again and rewritten


def test_doctor_shows_only_the_measurements_a_run_would_read(tiny, tmp_path):
    from ggufspec.paths import costs_file

    target = tmp_path / "t.gguf"
    target.write_bytes(Path(tiny["target"]).read_bytes())
    assert run("generate", "-m", target, "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    listed = lambda: [c["model"] for c in json.loads(run("doctor", "--json").output)["costs"]]
    assert listed() == [str(target.resolve())]
    cache = json.loads(costs_file().read_text())
    (key,) = [k for k in cache if k.startswith(str(target.resolve())) and not k.endswith("|draft")]
    older = key.replace("|b64|", "|b16|")  # an earlier version's measurement of the same file
    assert older != key
    costs_file().write_text(json.dumps({**cache, older: cache[key]}))
    assert listed() == [str(target.resolve())]
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed since: measured anew when run
    assert listed() == []
    target.unlink()
    assert listed() == [] and "measured costs on this machine: none yet" in run("doctor").output


def test_a_full_disk_leaves_no_temporary_cost_file(tiny, monkeypatch):
    from ggufspec.llama import measure as costs
    from ggufspec.paths import costs_file

    def full(self, data, *a, **kw):
        with open(self, "w") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    costs._save_cache({"k": {"token_seconds": 1.0}})
    monkeypatch.undo()
    assert not list(costs_file().parent.glob("*.tmp"))
