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
import sys

from .errors import GGUFSpecError


def _draft_for(settings, mode: str):
    from .llama_draft import GGUFDraftModel

    lookup = settings.draft_model == "lookup"  # prompt lookup alone, no second model
    return GGUFDraftModel(None if lookup else settings.draft_model, target=settings.model,
                          mode="lookup" if lookup else mode, num_pred_tokens=settings.draft_model_num_pred_tokens,
                          n_ctx=settings.n_ctx, n_threads=settings.n_threads)


def install(mode: str = "auto") -> None:
    """Make llama-cpp-python's server give each model it loads with a draft_model setting a
    GGUFDraftModel instead of its prompt lookup (its setting still sizes Llama's logits for drafting)."""
    from llama_cpp.server import model as server_model

    proxy = server_model.LlamaProxy
    original = proxy.__dict__["load_llama_from_model_settings"].__func__
    if getattr(original, "ggufspec", False):
        return

    def load_llama_from_model_settings(settings):
        llama = original(settings)
        if settings.draft_model is not None:
            try:
                draft = _draft_for(settings, mode)
            except BaseException:
                llama.close()
                raise
            llama.draft_model = draft
            print(f"ggufspec: {settings.model_alias or settings.model} drafts with {settings.draft_model} "
                  f"(mode {draft.mode}, up to {draft.num_pred_tokens} tokens)", file=sys.stderr, flush=True)
            atexit.register(lambda: print(f"ggufspec: {settings.draft_model}: drafted {draft.stats['drafted']}, "
                                          f"accepted {draft.stats['accepted']}", file=sys.stderr, flush=True))
        return llama

    load_llama_from_model_settings.ggufspec = True
    proxy.load_llama_from_model_settings = staticmethod(load_llama_from_model_settings)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--draft_mode", "--draft-mode", choices=("auto", "draft", "lookup"), default="auto")
    known, rest = ours.parse_known_args(argv)
    if not any(a == "--host" or a.startswith("--host=") for a in rest):
        rest += ["--host", "127.0.0.1"]  # never a public address unless asked
    try:
        import llama_cpp.server.__main__ as server_main
    except ImportError as e:
        print(f"ggufspec.llama_server: llama-cpp-python's server is not installed ({e.name} missing); "
              "run: pip install 'llama-cpp-python[server]'", file=sys.stderr)
        return 1
    install(known.draft_mode)
    sys.argv = ["python -m ggufspec.llama_server", *rest]
    try:
        server_main.main()
    except GGUFSpecError as e:
        print(f"ggufspec.llama_server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
