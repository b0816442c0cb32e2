"""models.toml parsing, overrides and name resolution."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec.cli.main import cli
from ggufspec.errors import GGUFSpecError
from ggufspec.models.resolve import resolve_models
from ggufspec.models.registry import BUILTIN, UnknownName, load_registry

SEED_PAIRS = ["llama-3.1-8b-instruct", "llama-3-70b-instruct", "llama-2-13b-chat", "gemma-7b-it", "llama-2-13b"]


def test_builtin_registry_has_the_default_pair_and_the_seed_pairs():
    reg = load_registry()
    assert reg.default_pair == "qwen2.5-coder-1.5b-q8_0"  # the CPU pair: where speculation pays on CPUs too
    pair = reg.pair("qwen2.5-coder-1.5b")
    assert reg.model(pair.target).n_layers == 28 and reg.model(pair.draft).n_layers == 24
    assert reg.model(pair.target).mirror.sha256.startswith("cc324af0")
    for name in SEED_PAIRS:
        p = reg.pair(name)
        assert reg.model(p.target).repo and reg.model(p.draft).file.endswith(".gguf")
    seventy = reg.pair("llama-3-70b-instruct")
    assert (seventy.n_gpu_layers, seventy.draft_n_gpu_layers) == (45, "all")
    assert reg.model("llama-3-70b-instruct").quant == "Q3_K_S" and reg.model("llama-3-8b-instruct").quant == "Q3_K_L"


def test_builtin_file_is_the_repository_one():
    assert BUILTIN.resolve() == (Path(__file__).parent.parent / "models.toml").resolve()


def test_unknown_name_suggests_close_matches():
    reg = load_registry()
    with pytest.raises(UnknownName, match="did you mean qwen2.5-coder-1.5b"):
        reg.pair("qwen2.5-coder-1.5")
    assert isinstance(UnknownName("x"), KeyError)


def test_malformed_file_reports_the_line(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text('[models.x]\nrepo = "a/b"\nfile = "x.gguf"\nn_layers = = 3\n')
    with pytest.raises(GGUFSpecError, match="line 4"):
        load_registry(bad)


def test_missing_keys_and_escaping_filenames_are_refused(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('[models.x]\nrepo = "a/b"\n')
    with pytest.raises(GGUFSpecError, match=r"\[models.x\] lacks `file`"):
        load_registry(f)
    for name in ("../../etc/passwd", "/abs/x.gguf", "a/../../x.gguf"):
        f.write_text(f'[models.x]\nrepo = "a/b"\nfile = "{name}"\n')
        with pytest.raises(GGUFSpecError, match="escape the models directory"):
            load_registry(f)
    f.write_text('[pairs.p]\ntarget = "nope"\ndraft = "qwen2.5-coder-0.5b-instruct"\n')
    with pytest.raises(GGUFSpecError, match="'nope' is not a model"):
        load_registry(f)


def test_user_registry_adds_and_overrides(tmp_path, monkeypatch):
    user = tmp_path / "mine.toml"
    user.write_text('default_pair = "mine"\n[models.m]\nrepo = "me/m"\nfile = "m.gguf"\n'
                    '[pairs.mine]\ntarget = "m"\ndraft = "qwen2.5-coder-0.5b-instruct"\n'
                    '[pairs."qwen2.5-coder-1.5b"]\ndraft_max = 2\n')
    reg = load_registry(user)
    assert reg.default_pair == "mine" and reg.pair("mine").target == "m"
    assert reg.pair("qwen2.5-coder-1.5b").settings["draft_max"] == 2
    assert reg.pair("qwen2.5-coder-1.5b").target == "qwen2.5-coder-1.5b-instruct"  # the rest is kept
    monkeypatch.setenv("GGUFSPEC_REGISTRY", str(user))
    assert load_registry().default_pair == "mine"
    monkeypatch.delenv("GGUFSPEC_REGISTRY")
    config = Path(tmp_path / "config" / "ggufspec")
    config.mkdir(parents=True)
    (config / "models.toml").write_text(user.read_text())
    assert load_registry().default_pair == "mine"


def test_pair_resolution_uses_local_files_and_pair_defaults(tiny, tmp_path):
    reg = tmp_path / "models.toml"
    reg.write_text('[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n[models.d]\nrepo = "x/d"\nfile = "d.gguf"\n'
                   '[pairs.td]\ntarget = "t"\ndraft = "d"\ndraft_max = 3\ntemperature = 0.2\n')
    models = Path(tmp_path / "models")
    models.mkdir()
    (models / "t.gguf").write_bytes(Path(tiny["target"]).read_bytes())
    (models / "d.gguf").write_bytes(Path(tiny["close"]).read_bytes())
    target, draft, defaults = resolve_models("td", None, None, registry=reg, offline=True)
    assert (target.name, draft.name) == ("t.gguf", "d.gguf")
    assert defaults["settings"] == {"draft_max": 3, "temperature": 0.2}
    r = CliRunner().invoke(cli, ["generate", "td", "--registry", str(reg), "-p", "hi", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output


def test_a_pairs_draft_max_is_draft_modes_length_and_does_not_cap_auto(tiny, tmp_path, monkeypatch):
    from ggufspec.engine import Engine

    reg = tmp_path / "models.toml"
    reg.write_text('[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n'
                   '[pairs.td]\ntarget = "t"\ndraft = "t"\ndraft_max = 1\n')
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "t.gguf").write_bytes(Path(tiny["target"]).read_bytes())
    seen, build = {}, Engine._build

    def recording(self, s, prompt_tokens):  # what the generation was asked for, then the real one
        seen[s.mode] = s.draft_max
        return build(self, s, prompt_tokens)

    monkeypatch.setattr(Engine, "_build", recording)
    for mode in ("draft", "auto"):
        r = CliRunner().invoke(cli, ["generate", "td", "--registry", str(reg), "-p", "hello world", "-n", "8",
                                     "--mode", mode, "--json"])
        assert r.exit_code == 0, r.output
    assert seen == {"draft": 1, "auto": None}  # None: auto drafts as far as the measured costs say pays
    r = CliRunner().invoke(cli, ["generate", "td", "--registry", str(reg), "-p", "hi", "-n", "8", "--draft-max", "3", "--json"])
    assert r.exit_code == 0 and seen["auto"] == 3  # a --draft-max typed by the user caps auto's model drafts


def test_models_list_shows_every_seed_pair():
    r = CliRunner().invoke(cli, ["models", "list"])
    assert r.exit_code == 0, r.output
    for name in SEED_PAIRS + ["qwen2.5-coder-1.5b-q8_0 (default)", "qwen2.5-coder-1.5b "]:
        assert name in r.output
    r = CliRunner().invoke(cli, ["models", "list", "--json"])
    data = json.loads(r.stdout)
    assert {p["name"] for p in data["pairs"]} >= set(SEED_PAIRS)


PAIRS_OF_2026 = ["qwen3-8b", "qwen3-14b", "qwen3-32b", "llama-3.3-70b-instruct", "gemma-3-27b-it", "gemma-3-27b-it-270m",
                 "qwen2.5-7b-instruct", "qwen2.5-14b-instruct", "qwen2.5-32b-instruct", "qwen3.6-27b-mtp",
                 "qwen3.6-35b-a3b-mtp"]


def test_every_shipped_entry_parses_and_names_its_file():
    """Each model: an owner/name repository, a .gguf file whose name carries the quantisation; unchecked
    entries claim no checksum; each pair's models are entries; the pairs of 2026 are there."""
    reg = load_registry()
    for spec in reg.models.values():
        assert spec.repo.count("/") == 1 and all(spec.repo.split("/")), spec.name
        assert spec.file.endswith(".gguf") and spec.quant and spec.quant.lower() in spec.file.lower(), spec.name
        assert spec.checked or spec.sha256 is None, spec.name  # a checksum nobody computed would be a lie
    for pair in reg.pairs.values():
        assert {m.name for m in reg.models_of(pair.name)} == {pair.target, pair.draft} - {None}
    assert set(PAIRS_OF_2026) <= set(reg.pairs) and reg.default_pair == "qwen2.5-coder-1.5b-q8_0"
    padded = reg.pair("qwen2.5-7b-instruct")
    assert (reg.model(padded.target).shape["n_vocab"], reg.model(padded.draft).shape["n_vocab"]) == (152064, 151936)
    for name in ("qwen3.6-27b-mtp", "qwen3.6-35b-a3b-mtp"):
        assert reg.pair(name).draft is None and reg.pair(name).settings["mode"] == "mtp"
    assert not any(reg.model(reg.pair(p).target).checked for p in PAIRS_OF_2026)  # written without the Hub


def test_models_list_marks_unchecked_entries(tmp_path):
    reg = tmp_path / "mine.toml"
    reg.write_text('[models.sure]\nrepo = "me/sure"\nfile = "sure-q8_0.gguf"\n'
                   '[models.guess]\nrepo = "them/guess"\nfile = "guess-q8_0.gguf"\nchecked = false\n'
                   '[pairs.guessed]\ntarget = "sure"\ndraft = "guess"\n[pairs.known]\ntarget = "sure"\ndraft = "sure"\n')
    r = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg)])
    assert r.exit_code == 0, r.output
    rows = {}
    for line in r.stdout.splitlines():  # a name's first row: the pair's where a pair and a model share it
        rows.setdefault(line.split(" ")[0], line)
    assert rows["guess"].endswith("Hub (unchecked)") and "unchecked" not in rows["sure"]
    assert "not downloaded (unchecked)" in rows["guessed"] and "unchecked" not in rows["known"]
    assert "unchecked: repository, file and size as their publishers name them" in r.stdout
    assert "qwen3.6-27b-mtp" in rows and "its MTP layers" in rows["qwen3.6-27b-mtp"]
    data = json.loads(CliRunner().invoke(cli, ["models", "list", "--registry", str(reg), "--json"]).stdout)
    assert {m["name"]: m["checked"] for m in data["models"]}.items() >= {"sure": True, "guess": False}.items()
    reg.write_text('[models.x]\nrepo = "a/x"\nfile = "x.gguf"\nchecked = "no"\n')
    bad = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg)])
    assert bad.exit_code == 1 and "[models.x] `checked` should be true or false, not 'no'" in bad.stderr


def test_a_pair_of_paths_lists_ready_only_where_its_files_are(tiny, tmp_path):
    """Before: a pair whose target or draft was a path (as `drafts --write` saved them) made `models list` fail on
    the whole registry ("no model named '/.../target.gguf'"); an absolute path without .gguf was refused."""
    reg = tmp_path / "mine.toml"
    plain = tmp_path / "model-file"  # no .gguf: an absolute path is still a path
    plain.write_bytes(Path(tiny["close"]).read_bytes())
    reg.write_text(f'[pairs.here]\ntarget = "{tiny["target"]}"\ndraft = "{plain}"\n'
                   f'[pairs.gone]\ntarget = "{tmp_path / "gone.gguf"}"\ndraft = "gemma-3-270m"\n')
    r = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg), "--json"])
    assert r.exit_code == 0, r.output
    pairs = {p["name"]: p for p in json.loads(r.stdout)["pairs"]}
    assert pairs["here"]["ready"] and not pairs["gone"]["ready"]
    assert [m.name for m in load_registry(reg).models_of("gone")] == ["gemma-3-270m"]


def test_models_check_of_a_pair_not_downloaded_says_so_in_one_line():
    r = CliRunner().invoke(cli, ["models", "check", "qwen3-8b"])
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert r.stderr.strip() == ("Error: qwen3-8b: not on this machine (Qwen/Qwen3-8B-GGUF, Qwen3-8B-Q4_K_M.gguf); "
                                "`ggufspec models pull qwen3-8b` downloads it (an unchecked entry: repository and file "
                                "as published, not verified)")


def test_a_pair_without_a_draft_drafts_with_the_targets_mtp_layers(tmp_path):
    from tiny_mtp import write_tiny_glm4moe_mtp

    mtp, plain = write_tiny_glm4moe_mtp(tmp_path / "mtp.gguf"), write_tiny_glm4moe_mtp(tmp_path / "plain.gguf", nextn=False)
    reg = tmp_path / "mine.toml"
    reg.write_text(f'[pairs.self]\ntarget = "{mtp}"\nmode = "mtp"\n[pairs.none]\ntarget = "{plain}"\nmode = "mtp"\n')
    ok = CliRunner().invoke(cli, ["models", "check", "self", "--registry", str(reg)])
    assert ok.exit_code == 0 and ok.stdout.strip() == "mtp.gguf carries 1 MTP layer of its own to draft with (--mode mtp)"
    bad = CliRunner().invoke(cli, ["models", "check", "none", "--registry", str(reg)])
    assert bad.exit_code == 1 and "plain.gguf: this model has no MTP (NextN) layers" in bad.stderr
    for mode in ("", 'mode = "draft"\n'):
        reg.write_text(f'[pairs.lost]\ntarget = "{mtp}"\n{mode}')
        r = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg)])
        assert r.exit_code == 1 and "[pairs.lost] lacks `draft` (a pair without one drafts with the target's own MTP " \
            "layers: set mode = \"mtp\")" in r.stderr


def test_models_info_and_check(tiny):
    r = CliRunner().invoke(cli, ["models", "info", str(tiny["target"]), "--json"])
    info = json.loads(r.stdout)
    assert (info["architecture"], info["n_layers"], info["n_vocab"], info["has_chat_template"]) == ("llama", 2, 354, True)
    ok = CliRunner().invoke(cli, ["models", "check", str(tiny["target"]), str(tiny["close"])])
    assert ok.exit_code == 0 and "compatible" in ok.stdout
    assert "same vocabulary: spm, 354 tokens" in ok.stdout
    other = CliRunner().invoke(cli, ["models", "check", str(tiny["target"]), str(tiny["other_vocab"])])
    assert other.exit_code == 0 and "across tokenizers, through text (token 259 differs (target '▁', draft '#'))" in other.stdout
    assert "on the 256 tokens both write alike (72% of the target's 354)" in other.stdout  # one id a text: its letter's, not its byte's


@pytest.mark.parametrize("line, needle", [
    ('temperature = "hot"', "[pairs.tp] --temp (temperature) must be a number (got 'hot', str)"),
    ("draft_max = 0", "[pairs.tp] --draft-max must be at least 1 (got 0)"),
    ('mode = "warp"', "[pairs.tp] --mode must be one of"),
])
def test_a_pairs_settings_are_checked_when_the_registry_is_read(tmp_path, line, needle):
    reg = tmp_path / "bad.toml"
    reg.write_text(f'[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n[pairs.tp]\ntarget = "t"\ndraft = "t"\n{line}\n')
    r = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg)])
    assert r.exit_code == 1 and needle in r.stderr and str(reg) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


MODEL = '[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n'
PAIR = '[pairs.tp]\ntarget = "t"\ndraft = "t"\n'


@pytest.mark.parametrize("text, needle", [
    (MODEL + "sha256 = 123\n", "[models.t] `sha256` should be a string, not 123"),
    (MODEL + 'sha256 = "zzzz-not-hex"\n', "[models.t] sha256 = 'zzzz-not-hex' is not 64 hexadecimal digits"),
    (MODEL + 'sha256 = "' + "a" * 63 + '"\n', "is not 64 hexadecimal digits"),
    (MODEL + 'n_params = "big"\n', "[models.t] `n_params` should be an integer or a number, not 'big'"),
    ("[models]\nx = 5\n", "models.x should be a table ([models.x] with repo and file), not 5"),
    (MODEL + '[pairs.tp]\ntarget = 5\ndraft = "t"\n', "[pairs.tp] `target` should be a string, not 5"),
    ('pairs = "nope"\n', "`pairs` should be a table ([pairs.NAME] sections), not 'nope'"),
    ("models = 4\n", "`models` should be a table"),
    ("default_pair = 3\n", "`default_pair` should be a string, not 3"),
    (MODEL + PAIR + 'n_gpu_layers = "banana"\n', "[pairs.tp] n_gpu_layers = 'banana' should be a number of layers"),
    (MODEL + PAIR + "draft_n_gpu_layers = -2\n", "[pairs.tp] draft_n_gpu_layers = -2 should be a number of layers"),
    (MODEL + PAIR + "n_gpu_layers = true\n", "n_gpu_layers = True should be a number of layers"),
    (MODEL + PAIR + "n_cpu_moe = -1\n", "[pairs.tp] n_cpu_moe = -1 should be a number of layers"),
])
def test_values_of_the_wrong_type_name_the_file_key_and_type(tmp_path, text, needle):
    reg = tmp_path / "user.toml"
    reg.write_text(text)
    r = CliRunner().invoke(cli, ["models", "list", "--registry", str(reg)])
    assert r.exit_code == 1 and needle in r.stderr and str(reg) in r.stderr, r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_registry_that_is_not_utf8_says_so(tmp_path):
    reg = tmp_path / "user.toml"
    reg.write_bytes(b'[models.t]\nrepo = "caf\xe9"\n')
    with pytest.raises(GGUFSpecError, match=r"user.toml: not UTF-8 text \(byte 22\); save the registry as UTF-8"):
        load_registry(reg)


def test_good_values_still_load(tmp_path):
    reg = tmp_path / "user.toml"
    reg.write_text(MODEL + 'sha256 = "' + "AB" * 32 + '"\nn_params = 1.5\n' + PAIR + 'n_gpu_layers = "all"\ndraft_n_gpu_layers = 0\n'
                   'n_cpu_moe = 3\n')
    r = load_registry(reg)
    assert r.model("t").sha256 == "ab" * 32 and r.pair("tp").n_gpu_layers == "all" and r.pair("tp").draft_n_gpu_layers == 0
    assert r.pair("tp").n_cpu_moe == 3


@pytest.mark.parametrize("kind, needle", [
    ({"weights": False}, "holds a vocabulary and no weights (a vocab-only GGUF); give the draft's model file itself"),
    ({"arch": "gpt2"}, "llama.cpp could not load this draft (error loading model hyperparameters: key not found in "
                       "model: gpt2.attention.layer_norm_epsilon)"),
    ({"head_count": 0}, "llama.cpp could not load this draft (check_tensor_dims: tensor 'blk.0.attn_q.weight' has wrong shape"),
])
def test_models_check_says_compatible_only_of_a_draft_that_loads(tiny, tmp_path, kind, needle):
    """A vocabulary that matches is not yet a model: a vocab-only file, another architecture's header, a header
    with 0 heads pass the vocabulary checks, and `generate` would fail to load them."""
    from tiny import write_tiny_model

    bad = write_tiny_model(tmp_path / "bad.gguf", **kind)
    r = CliRunner().invoke(cli, ["models", "check", str(tiny["target"]), str(bad)])
    assert r.exit_code == 1 and "compatible" not in r.stdout and needle in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
    gen = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-md", str(bad), "-p", "hi", "-n", "2"])
    assert gen.exit_code == 1 and needle in gen.stderr  # the same reason where it would have failed
    swapped = CliRunner().invoke(cli, ["models", "check", str(bad), str(tiny["target"])])
    assert swapped.exit_code == 1 and needle.replace("draft", "target") in swapped.stderr


# The user's registry as they wrote it: comments, quoted and bare section names, values ggufspec never reads
# (an array, a datetime, a table of their own), a pair defined before the one tune writes.
USER_FILE = '''# my registry: pairs for the office GPU box
default_pair = "mine"   # the one I use

[models.m]  # a local fine-tune
repo = "me/m"
file = "m.gguf"
tags = ["local", "fine-tune"]

[pairs."mine"]
target = "m"  # mine
draft = "qwen2.5-coder-0.5b-instruct"
mode = "draft"  # was draft

[pairs.other]
target = "m"
draft = "m"

[notes]
updated = 2024-05-27T07:32:00Z
'''


def test_save_pair_edits_only_the_pairs_table_and_keeps_the_file_as_written(tmp_path):
    """Before: every comment deleted, sections re-quoted, and an array or a datetime a TypeError."""
    from ggufspec.models.registry import save_pair

    reg = tmp_path / "models.toml"
    reg.write_text(USER_FILE)
    assert save_pair(reg, "mine", {"mode": "auto", "draft_max": 2}) == reg
    assert reg.read_text() == USER_FILE.replace('mode = "draft"  # was draft\n',
                                                'mode = "auto"  # was draft\ndraft_max = 2\n')
    save_pair(reg, "qwen2.5-coder-1.5b", {"draft_max": 3})  # a built-in pair: a table of its own, added
    assert reg.read_text() == USER_FILE.replace('mode = "draft"  # was draft\n', 'mode = "auto"  # was draft\ndraft_max = 2\n'
                                                ).replace("[notes]", '[pairs."qwen2.5-coder-1.5b"]\ndraft_max = 3\n\n[notes]')
    r = load_registry(reg)
    assert r.pair("mine").settings == {"mode": "auto", "draft_max": 2}
    assert r.pair("qwen2.5-coder-1.5b").settings["draft_max"] == 3 and r.pair("qwen2.5-coder-1.5b").target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.toml", "models.toml.lock"]  # no temporary file


def test_save_pair_writes_through_a_link(tmp_path):
    """A registry kept in a dotfiles repository and linked: the link stays, its target gets the values."""
    from ggufspec.models.registry import save_pair

    real = tmp_path / "dotfiles" / "models.toml"
    real.parent.mkdir()
    real.write_text(USER_FILE)
    link = tmp_path / "config" / "models.toml"
    link.parent.mkdir()
    link.symlink_to(real)
    assert save_pair(link, "other", {"n_gpu_layers": 12}) == real
    assert link.is_symlink() and load_registry(link).pair("other").n_gpu_layers == 12
    assert "n_gpu_layers = 12" in real.read_text() and "# my registry" in real.read_text()


def test_save_pair_never_writes_a_registry_that_would_not_load(tmp_path):
    """The pair was renamed while tune measured: before, [pairs.mine] came back as a stub lacking `target`, and
    every later command failed on the file."""
    from ggufspec.models.registry import save_pair

    reg = tmp_path / "models.toml"
    renamed = USER_FILE.replace('[pairs."mine"]', '[pairs."mine-v2"]').replace('"mine"   #', '"mine-v2"   #')
    reg.write_text(renamed)
    with pytest.raises(GGUFSpecError, match=r"models.toml: the setting for pair 'mine' was not saved: there is no pair "
                                            r"'mine' in it or the registries under it any more \(renamed or removed\?\)"):
        save_pair(reg, "mine", {"mode": "auto"})
    with pytest.raises(GGUFSpecError, match=r"not saved: \[pairs.other\] --temp must be a finite number"):
        save_pair(reg, "other", {"temperature": -1})
    assert reg.read_text() == renamed and load_registry(reg).pair("mine-v2").target == "m"


def test_save_pair_where_nothing_can_be_written_says_so_and_leaves_nothing(tmp_path):
    from ggufspec.models.registry import save_pair

    (tmp_path / "file").write_text("x")
    with pytest.raises(GGUFSpecError, match=r"file/models.toml: cannot write the registry \(\S+/file is a file, not a folder\); "
                                            "nothing was saved"):
        save_pair(tmp_path / "file" / "models.toml", "other", {"mode": "auto"})
    reg = tmp_path / "models.toml"
    reg.write_text(USER_FILE)
    try:  # immutable (chattr +i): refused even to root, before and without a temporary file
        subprocess.run(["chattr", "+i", str(reg)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("chattr +i is not available here")
    try:
        for check_only in (True, False):
            with pytest.raises(GGUFSpecError, match=r"cannot write the registry \(Operation not permitted\)"):
                save_pair(reg, "other", {"mode": "auto"}, check_only=check_only)
    finally:
        subprocess.run(["chattr", "-i", str(reg)], check=True)
    assert reg.read_text() == USER_FILE and sorted(p.name for p in tmp_path.iterdir()) == [
        "file", "models.toml", "models.toml.lock"]


def test_concurrent_registry_writers_lose_nothing(tmp_path):
    """Before: one shared models.toml.tmp and no lock (FileNotFoundError, pairs lost)."""
    reg = tmp_path / "models.toml"
    reg.write_text(USER_FILE)
    code = ("import sys\nfrom ggufspec.models.registry import save_pair\nk = sys.argv[1]\nfor i in range(12):\n"
            "    save_pair(sys.argv[2], f'p{k}-{i}', {'target': 'm', 'draft': 'm', 'draft_max': i + 1})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k), str(reg)], stderr=subprocess.PIPE, text=True)
             for k in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    pairs = load_registry(reg).pairs
    assert all(f"p{k}-{i}" in pairs for k in range(4) for i in range(12))
    assert "# my registry" in reg.read_text() and [p.name for p in tmp_path.glob("*.tmp")] == []
