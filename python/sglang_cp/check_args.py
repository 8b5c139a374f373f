"""``sglang-cp check-args``: a launch_server command line through SGLang's own parser and resolution,
with the plugin loaded, without starting a server, on any machine: a CPU laptop checks a GPU
server's line.

What it does beyond ``prepare_server_args(argv).resolve_once()``, so that it works off the serving host:

- **model**: it reads the model's ``config.json`` and never downloads. A local directory is read; a
  Hugging Face id is read from the local Hugging Face cache (the process runs with
  ``HF_HUB_OFFLINE=1``); neither fails at once in one line saying what it needs, instead of
  upstream's ~50 s of retries and an 87-line ``OSError`` traceback.
- **device**: with no ``--device`` on a machine without an accelerator it checks the line as for
  ``--device cuda`` (a GPU server's), instead of upstream's ``RuntimeError: No accelerator``.
- **L3**: besides our loader's checks, a config whose ranks a live process owns is refused, and so is
  a ``capacity_gb`` beyond a disk's free space (``doctor.space_problems``, the check doctor runs).
- **errors**: every rejection is one line; argparse's errors come without SGLang's whole usage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Optional

from sglang_cp.args import CpArgsError

# Set before sglang (and so huggingface_hub / transformers, which read them at import) is imported.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
DEVICE_WITHOUT_ACCELERATOR = "cuda"


class CheckArgsError(ValueError):
    """A command line check-args rejects; the message is one line naming the argument and the fix."""


def _looks_like_a_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") >= 2  # a hub id is org/name


def model_problem(model: Optional[str], revision: Optional[str] = None) -> Optional[str]:
    """None when ``model`` can be read here without a download; else one line naming what is needed."""
    if model is None or model.lower() in ("dummy", "none") or os.path.exists(os.path.expanduser(model)):
        return None  # no model path: upstream's own error; a local one: upstream reads it
    need = ("check-args reads the model's config.json (no weights) and never downloads: pass a local model "
            "directory that holds config.json (and the model's *.py files if it needs --trust-remote-code)")
    if _looks_like_a_path(model):
        return f"--model-path {model!r}: no such file or directory here; {need}"
    if os.environ.get("SGLANG_USE_MODELSCOPE", "").lower() in ("1", "true", "yes", "on"):
        return f"--model-path {model!r}: a ModelScope id; {need}"
    try:
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str):
            return None
        cache = constants.HF_HUB_CACHE
    except Exception:  # not a valid repo id, or no huggingface_hub: nothing cached either way
        cache = "the Hugging Face cache"
    return (f"--model-path {model!r}: not a local directory, and its config.json is not in the Hugging Face "
            f"cache here ({cache}); {need}, or fetch its config first: hf download {model} config.json")


def _pre_parse_model(argv: list[str]) -> tuple[Optional[str], Optional[str]]:
    """``--model-path`` and ``--revision`` as written (before sglang is imported, which takes seconds)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path")
    p.add_argument("--revision")
    ns, _ = p.parse_known_args(argv)
    return ns.model_path, ns.revision


@contextlib.contextmanager
def _argparse_errors_raise():
    """argparse's ``error()`` prints the parser's usage (SGLang's: some 480 lines) and exits; here it
    raises the message instead. Only for this process's own parse."""
    def error(self, message):
        raise CheckArgsError(message)

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


def _has_accelerator() -> bool:
    from sglang.srt.utils.common import get_device

    try:
        get_device()
        return True
    except RuntimeError:
        return False


def parse_launch_args(argv: list[str], notes: Optional[list] = None):
    """Run SGLang's own parse + resolution on ``argv`` with our plugin loaded, as check-args does
    (see the module docstring); ``notes`` collects what it defaulted."""
    for k, v in OFFLINE_ENV.items():  # before anything imports huggingface_hub, which reads them once
        os.environ.setdefault(k, v)
    problem = model_problem(*_pre_parse_model(argv))
    if problem:
        raise CheckArgsError(problem)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    with _argparse_errors_raise():
        server_args = prepare_server_args(argv)
    problem = model_problem(server_args.model_path, getattr(server_args, "revision", None))
    if problem:  # written in a form the pre-parse does not know (an abbreviation)
        raise CheckArgsError(problem)
    if getattr(server_args, "device", None) is None and not _has_accelerator():
        server_args.device = DEVICE_WITHOUT_ACCELERATOR
        if notes is not None:
            notes.append(f"no accelerator on this machine: checked as for --device {DEVICE_WITHOUT_ACCELERATOR} "
                         "(a GPU server); pass --device to check for another")
    server_args.resolve_once()
    return server_args


def check_l3_where_it_will_run(server_args) -> None:
    """What the store would refuse at startup that a parse alone does not see: a live owner of its ranks,
    slab files that do not fit on their disk."""
    from sglang_cp import args as cp_args
    from sglang_cp.doctor import space_problems
    from sglang_cp.integration.cp_l3.backend_select import check_no_live_owner

    check_no_live_owner(server_args)
    f = cp_args.flags_of(server_args)
    if f.enable_cp_l3 and f.cp_l3_config:
        problems = space_problems(cp_args.load_config(f.cp_l3_config))
        if problems:
            raise CpArgsError(f"--cp-l3-config {f.cp_l3_config}: {problems[0]}")


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
