"""scripts/uv_args.py: pip's configuration, as ``pip config list`` prints it, becomes the uv arguments
setup_env.sh installs with -- the same wheel dirs, indexes and constraints for both installers."""

import importlib.util
import os
import subprocess
import sys

from suite_helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "uv_args.py")
spec = importlib.util.spec_from_file_location("uv_args", SCRIPT)
uv_args = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_args)


def test_each_key_pip_resolves_maps_to_uvs_flag():
    lines = ["global.find-links='\\n/w1\\n/w2'",  # a multi-line value, as pip prints it
             ":env:.find-links='/opt/wheels'",
             "global.extra-index-url='file:///a/simple file:///b/simple'",
             "global.index-url='https://mirror/simple'",
             "global.constraint='/etc/xdg/pip/constraints.txt'",
             "global.no-index='false'",
             "global.cert='/etc/ssl/certs/ca-certificates.crt'",
             ":env:.default-timeout='180'", ":env:.disable-pip-version-check='1'", "not a config line"]
    assert uv_args.from_pip_config(lines) == [
        "--find-links", "/w1", "--find-links", "/w2", "--find-links", "/opt/wheels",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--index-url", "https://mirror/simple", "--constraint", "/etc/xdg/pip/constraints.txt",
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]
    assert uv_args.from_pip_config(["user.no-index='yes'"]) == ["--no-index"]
    assert uv_args.from_pip_config([]) == []


def test_the_script_reads_pips_own_resolution_of_files_and_variables(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links =\n    /w1\n    /w2\nextra-index-url = file:///x/simple\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_CONSTRAINT="/c.txt")
    p = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    # this file's values, in pip's order; the machine's own pip.conf files may add theirs around them
    for flag, value in (("--find-links", "/w1"), ("--find-links", "/w2"), ("--extra-index-url", "file:///x/simple"),
                        ("--constraint", "/c.txt")):
        assert any(out[i:i + 2] == [flag, value] for i in range(len(out) - 1)), (flag, value, out)
