"""uv's arguments for what pip's own configuration says, so setup_env.sh's two installers read the same
wheel dirs, indexes and constraints (uv reads none of pip's configuration files or PIP_* variables).

    python scripts/uv_args.py     # one line per uv argument; SSL_CERT_FILE=PATH last when pip has a cert

It reads ``python -m pip config list`` (files and PIP_* variables, as pip itself resolves them; each
value printed as a Python literal) and maps find-links, index-url, extra-index-url, constraint and a true
no-index; pip's cert becomes SSL_CERT_FILE, uv's way to trust a certificate bundle. Other keys
(timeouts, pip's own version check) have no bearing on what gets installed."""

from __future__ import annotations

import ast
import subprocess
import sys

MULTI = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
TRUE = {"1", "true", "yes", "on"}


def from_pip_config(lines: list) -> list:
    """``pip config list`` lines (``scope.key='value'``) -> the output lines described above."""
    args, cert = [], None
    for line in lines:
        name, sep, literal = line.partition("=")
        if not sep:
            continue
        key = name.rsplit(".", 1)[-1]
        try:
            value = ast.literal_eval(literal)
        except (SyntaxError, ValueError):
            value = literal.strip("'\"")
        value = str(value)
        if key in MULTI:  # pip splits these on whitespace, newlines included
            for v in value.split():
                args += [MULTI[key], v]
        elif key == "index-url" and value.strip():
            args += ["--index-url", value.strip()]
        elif key == "no-index" and value.strip().lower() in TRUE:
            args.append("--no-index")
        elif key == "cert" and value.strip():
            cert = value.strip()
    return args + ([f"SSL_CERT_FILE={cert}"] if cert else [])


def main() -> int:
    p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        print(f"uv_args: pip config list exited {p.returncode}: {p.stderr.strip()[:300]}", file=sys.stderr)
        return 1
    print("\n".join(from_pip_config(p.stdout.splitlines())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
