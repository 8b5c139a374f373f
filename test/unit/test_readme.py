"""README stays true: the generated flags table matches args.py, the two commands are the
Makefile's, and every error message we raise at startup has a Troubleshooting row."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(REPO, "README.md")).read()
ERRORS = ("CpArgsError", "L3ConfigError", "L3StartupError", "HugepageL2Error", "NotHugetlbfsError",
          "InsufficientHugepagesError", "SlabPlanError", "SlabOwnershipError", "L3OwnershipError")


def _section(title: str) -> str:
    a = README.index(f"## {title}")
    b = README.find("\n## ", a + 1)
    return README[a:b if b > 0 else None]


def test_flags_table_is_generated_from_args_py():
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gen_flags_table.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    from sglang_cp.args import FLAG_NAMES

    flags = _section("Flags")
    for name in FLAG_NAMES:
        assert f"`--{name.replace('_', '-')}" in flags, name


def test_the_two_commands_are_the_makefiles():
    two = _section("The two commands")
    assert "```\nmake demo\n```" in two and "```\nmake test\n```" in two
    make = open(os.path.join(REPO, "Makefile")).read()
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "sglang-cp cachebench --quick --out-dir out/cachebench" in demo
    assert "sglang-cp cachebench --quick --out-dir out/cachebench" in two
    assert re.search(r"^test:.*\n\t.*pytest.* test$", make, re.M)


def _raised_messages():
    pat = re.compile(r"raise (%s)\(\s*(?:f?\"([^\"]*)\")" % "|".join(ERRORS))
    for dirpath, _, files in os.walk(os.path.join(REPO, "python", "sglang_cp")):
        for f in files:
            if f.endswith(".py"):
                src = open(os.path.join(dirpath, f)).read()
                for m in pat.finditer(src):
                    yield os.path.join(dirpath, f), m.group(2)


def _key(msg: str) -> str | None:
    """The fixed words a message starts with: up to its first colon (the flag or field it
    names), placeholder or quote, at most five words."""
    lead = re.split(r"[{'(:]", msg, maxsplit=1)[0].strip().rstrip("=").strip()
    lead = " ".join(lead.split()[:5])
    return lead if len(lead) >= 10 else None


def test_every_startup_error_has_a_troubleshooting_row():
    rows = _section("Troubleshooting")
    seen, missing = 0, []
    for path, msg in _raised_messages():
        key = _key(msg)
        if key is None:
            continue  # starts with a field path filled in at run time: covered by the generic rows
        seen += 1
        if key not in rows:
            missing.append(f"{os.path.relpath(path, REPO)}: {key!r}")
    assert seen > 20, "the scan found too few raise sites: the pattern broke"
    assert not missing, "README Troubleshooting lacks:\n" + "\n".join(missing)
