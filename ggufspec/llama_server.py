"""`python -m ggufspec.llama_server` wrapped llama-cpp-python's server, one request at a time; `ggufspec serve`
replaced it (several requests in one batched verify, every mode). This says so, with the command that does
what the given flags asked, and exits 2."""

from __future__ import annotations

import shlex
import sys

# llama-cpp-python server flags -> ggufspec serve's
FLAGS = {"--model": "-m", "--draft_model": "-md", "--host": "--host", "--port": "--port", "--n_ctx": "-c",
         "--n_threads": "-t", "--n_gpu_layers": "-ngl", "--draft_mode": "--mode", "--draft-mode": "--mode",
         "--model_alias": "--alias", "--draft_model_num_pred_tokens": "--draft-max"}


def equivalent(argv: list[str]) -> list[str]:
    """The `ggufspec serve` command line for llama_server's flags (those it has no counterpart for are left out)."""
    out, i = ["ggufspec", "serve"], 0
    while i < len(argv):
        name, _, value = argv[i].partition("=")
        if name in FLAGS:
            if not value and i + 1 < len(argv):
                i += 1
                value = argv[i]
            if name == "--draft_model" and value == "lookup":
                out += ["--mode", "lookup"]
            else:
                out += [FLAGS[name], value]
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print("ggufspec.llama_server was replaced by `ggufspec serve` (an OpenAI-compatible server that serves several "
          f"requests at once; docs/serve.md): run  {shlex.join(equivalent(argv))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
