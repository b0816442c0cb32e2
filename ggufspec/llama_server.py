"""llama-cpp-python's OpenAI-compatible server with a GGUF draft model.

    python -m ggufspec.llama_server --model target.gguf --draft_model draft.gguf [--draft_mode auto]

Every flag of `python -m llama_cpp.server` works as there (it parses them). Its own `--draft_model`
only switches on prompt lookup, whatever it names; here it names the draft: a .gguf path, a
model name from models.toml, or `lookup` (ggufspec's prompt lookup, no second model).
`--draft_mode auto|draft|lookup` (default auto: draft only where it pays on this machine) and
`--draft_model_num_pred_tokens N` shape it. It binds 127.0.0.1 unless --host says otherwise.
Needs the server's extras: pip install 'llama-cpp-python[server]' (or ggufspec[server]).
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys

from .core import LLAMA_MODES
from .errors import GGUFSpecError


def _draft_for(settings, mode: str):
    from .llama_draft import GGUFDraftModel

    lookup = settings.draft_model == "lookup"  # prompt lookup alone, no second model
    return GGUFDraftModel(None if lookup else settings.draft_model, target=settings.model,
                          mode="lookup" if lookup else mode, num_pred_tokens=settings.draft_model_num_pred_tokens,
                          n_ctx=settings.n_ctx, n_threads=settings.n_threads)


_open: list = []  # (name, draft) of the model the server holds now


def _close_drafts() -> None:
    """Report and close the drafts of the model being replaced (or of the server, at exit)."""
    while _open:
        name, draft = _open.pop()
        print(f"ggufspec: {name}: drafted {draft.stats['drafted']}, accepted {draft.stats['accepted']}",
              file=sys.stderr, flush=True)
        draft.close()


def install(mode: str = "auto") -> None:
    """Make llama-cpp-python's server give each model it loads with a draft_model setting a
    GGUFDraftModel instead of its prompt lookup (its setting still sizes Llama's logits for drafting).
    The draft is built first, so a draft that cannot serve the target is one line before the target
    loads; the server holds one model at a time, and a model's draft is closed when it is replaced."""
    from .llama.runtime import server_modules

    server_model, _ = server_modules()
    proxy = server_model.LlamaProxy
    original = proxy.__dict__["load_llama_from_model_settings"].__func__
    if getattr(original, "ggufspec", False):
        return

    def load_llama_from_model_settings(settings):
        _close_drafts()  # the proxy has freed the model those served
        draft = _draft_for(settings, mode) if settings.draft_model is not None else None
        try:
            llama = original(settings)
        except BaseException:
            if draft is not None:
                draft.close()
            raise
        if draft is not None:
            llama.draft_model = draft
            draft.attach(llama)
            _open.append((settings.draft_model, draft))
            print(f"ggufspec: {settings.model_alias or settings.model} drafts with {settings.draft_model} "
                  f"(mode {draft.mode}, up to {draft.num_pred_tokens} tokens)", file=sys.stderr, flush=True)
        return llama

    load_llama_from_model_settings.ggufspec = True
    proxy.load_llama_from_model_settings = staticmethod(load_llama_from_model_settings)
    atexit.register(_close_drafts)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--draft_mode", "--draft-mode", choices=LLAMA_MODES, default="auto")
    known, rest = ours.parse_known_args(argv)
    named = {a.split("=", 1)[0] for a in rest}
    if not ({"--model", "--config_file"} & named or os.environ.get("MODEL") or os.environ.get("CONFIG_FILE")
            or {"-h", "--help"} & named):
        print("ggufspec.llama_server: give the target with --model TARGET.gguf (and the draft with --draft_model "
              "DRAFT.gguf), or a --config_file", file=sys.stderr)
        return 2
    if not any(a == "--host" or a.startswith("--host=") for a in rest):
        rest += ["--host", "127.0.0.1"]  # never a public address unless asked
    from .llama.runtime import server_modules

    try:
        _, server_main = server_modules()
    except ImportError as e:
        print(f"ggufspec.llama_server: llama-cpp-python's server is not installed ({e.name} missing); "
              "run: pip install 'llama-cpp-python[server]'", file=sys.stderr)
        return 1
    install(known.draft_mode)
    # uvicorn stops on SIGTERM, then raises it again under the handler it found: the default one would end the
    # process before atexit reports the drafted and accepted totals, as it does after Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.argv = ["python -m ggufspec.llama_server", *rest]
    try:
        server_main.main()
    except GGUFSpecError as e:
        print(f"ggufspec.llama_server: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
