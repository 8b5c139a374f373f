"""README and docs/ stay true.

The generated flags table matches args.py; the two commands are the Makefile's; the demo block is
the generator's, with the Makefile's commands in order; the GPU section's launch lines are the
example script's; the startup line, response fields and metric names it quotes are the ones the
code writes; every startup error has a Troubleshooting row; every link and repository path named
resolves; each docs/ page is linked from the README; the README stays short enough to read.
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(REPO, "README.md")).read()
DOCS = os.path.join(REPO, "docs")
DOC_PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
ERRORS = ("CpArgsError", "L3ConfigError", "L3StartupError", "HugepageL2Error", "NotHugetlbfsError",
          "InsufficientHugepagesError", "SlabPlanError", "SlabOwnershipError", "L3OwnershipError",
          "CheckArgsError")


def _read(*parts):
    return open(os.path.join(REPO, *parts)).read()


def _section(title: str, text: str = README) -> str:
    a = text.index(f"## {title}")
    b = text.find("\n## ", a + 1)
    return text[a:b if b > 0 else None]


def test_flags_table_is_generated_from_args_py():
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gen_flags_table.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    from sglang_cp.args import FLAG_NAMES

    flags = _section("Flags")
    for name in FLAG_NAMES:
        assert f"`--{name.replace('_', '-')}" in flags, name


def _demo_recipe():
    make = _read("Makefile")
    return [x.strip() for x in re.search(r"^demo:.*\n((?:\t.*\n)+)", make, re.M).group(1).splitlines()]


def test_the_two_commands_are_the_makefiles():
    two = _section("The two commands")
    assert "```\nmake demo\n```" in two and "```\nmake test\n```" in two
    assert "sglang-cp cachebench --out-dir out/cachebench" in _demo_recipe()[0]
    assert "sglang-cp cachebench --out-dir out/cachebench" in two
    assert re.search(r"^test:.*\n\t.*pytest.* test$", _read("Makefile"), re.M)


def test_the_demo_block_is_the_generators_with_the_makefiles_commands():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import update_readme_demo as gen

    a, b = README.index(gen.BEGIN), README.index(gen.END)
    block = README[a:b]
    head = block.splitlines()[1]
    assert head.startswith("Generated ") and " cores, " in head and " GiB RAM" in head and "setup " in head
    lines = block.splitlines()
    assert "$ make demo" in lines
    at = [lines.index(cmd) for cmd in _demo_recipe()]  # every command, in the Makefile's order
    assert at == sorted(at), at
    assert gen.demo_commands(os.path.join(REPO, "Makefile")) == _demo_recipe()


def _launch_args(text: str, entry: str) -> list:
    m = re.search(rf"^{re.escape(entry)} \\\n((?:.*\\\n)*.*)$", text, re.M)
    assert m, f"no `{entry} \\` line"
    return shlex.split(m.group(1).replace("\\\n", " ").replace('"$@"', ""), posix=False)


def test_the_gpu_launch_lines_are_the_example_scripts():
    script = _read("examples", "launch_single_gpu_l3.sh")
    want = _launch_args(script, "exec python -m sglang.launch_server")
    gpu = _section("On a GPU server")
    assert _launch_args(gpu, "python -m sglang.launch_server") == want
    assert _launch_args(gpu, "sglang serve") == want
    assert '"$MODEL"' in want and '"$L3_CONFIG"' in want and "--enable-cp-l3" in want


def test_the_quoted_startup_line_is_the_plugins():
    """The line's format string in integration/cp_l3/backend.py, filled as one GPU fills it."""
    from sglang_cp.integration.cp_l3.identity import L3Identity

    src = _read("python", "sglang_cp", "integration", "cp_l3", "backend.py")
    fmt = re.search(r'logger\.info\("(sglang-cp L3 backend ready: [^"]*)"', src).group(1)
    one_gpu = L3Identity(replica=0, pp_rank=0, tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_tp_rank=0,
                         node_rank=0, local_rank=0, local_count=1)
    head, tail = fmt.split("payloads %s")
    want_head = head % (one_gpu.label(), 0, 1)
    want_tail = tail % ("durable",)
    m = re.search(r"^(sglang-cp L3 backend ready: .*)$", _section("On a GPU server"), re.M)
    assert m, "README quotes no startup line"
    line = m.group(1)
    assert line.startswith(want_head + "payloads {'kv': ") and line.endswith("}" + want_tail), (line, want_head)


def _upstream_source(module: str) -> str:
    spec = importlib.util.find_spec("sglang")  # the installed sglang, read as text (no import)
    path = os.path.join(os.path.dirname(spec.origin), *module.split(".")[1:]) + ".py"
    return open(path).read()


def test_the_response_fields_and_metrics_it_names_are_real():
    from sglang_cp.metrics import metric_names

    gpu = _section("On a GPU server")
    streamer = _upstream_source("sglang.srt.managers.scheduler_components.output_streamer")
    assert "cached_tokens_details" in gpu
    for key in ("device", "host", "storage", "storage_backend"):
        assert f"'{key}': " in gpu and f'"{key}"' in streamer, key
    assert "'storage_backend': 'CpL3Storage'" in gpu
    assert "class CpL3Storage(" in _read("python", "sglang_cp", "integration", "cp_l3", "backend.py")
    named = set(re.findall(r"sglang:cp_l3_[a-z_]+", README))
    assert named and named <= set(metric_names()), named - set(metric_names())


def test_the_configuration_page_lists_every_metric():
    from sglang_cp.metrics import metric_names

    page = _read("docs", "configuration.md")
    listed = set(re.findall(r"`(sglang:cp_l3_[a-z_]+)`", _section("Metrics", page)))
    assert listed == set(metric_names())


def test_the_install_section_names_the_pin_and_the_dependencies():
    from sglang_cp.plugin import SGLANG_PIN

    gpu = _section("On a GPU server")
    assert f'pip install "sglang=={SGLANG_PIN}"' in gpu and f"SGLang {SGLANG_PIN} exactly" in gpu
    deps = re.search(r"dependencies = \[(.*?)\]", _read("pyproject.toml"), re.S).group(1)
    names = [re.split(r"[=<>;\s]", d.strip().strip('",'))[0] for d in deps.strip().splitlines() if d.strip()]
    for name in names:
        if name != "tomli":  # Python < 3.11 only
            assert f"`{name}" in gpu, name


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
    rows = _read("docs", "troubleshooting.md")
    seen, missing = 0, []
    for path, msg in _raised_messages():
        key = _key(msg)
        if key is None:
            continue  # starts with a field path filled in at run time: covered by the generic rows
        seen += 1
        if key not in rows:
            missing.append(f"{os.path.relpath(path, REPO)}: {key!r}")
    assert seen > 20, "the scan found too few raise sites: the pattern broke"
    assert not missing, "docs/troubleshooting.md lacks:\n" + "\n".join(missing)


def test_the_one_line_errors_of_our_flags_and_tools_have_rows():
    rows = _read("docs", "troubleshooting.md")
    for start in ("must be one of ...; got", "is not a number", "is given twice", "is pinned to sglang==",
                  "failed to register", "not in the Hugging Face cache", "does not fit on",
                  "rejected by SGLang", "write cache is volatile"):
        assert start in rows, start


def _markdown_files():
    yield "README.md", README
    yield "docs_internal/README.md", _read("docs_internal", "README.md")
    for page in DOC_PAGES:
        yield f"docs/{page}", _read("docs", page)


def _anchors(text: str) -> set:
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_and_named_path_resolves():
    bad = []
    for name, text in _markdown_files():
        base = os.path.dirname(os.path.join(REPO, name))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(REPO, name)
            if not os.path.exists(full):
                bad.append(f"{name}: link {target}")
            elif anchor and full.endswith(".md") and anchor not in _anchors(open(full).read()):
                bad.append(f"{name}: anchor {target}")
        for path in re.findall(r"`((?:examples|docs|docs_internal|scripts|benchmark|test|python)/[^`\s*<>]+)`", text):
            path = path.rstrip(".,;:")
            if "{" in path:
                continue
            if not os.path.exists(os.path.join(REPO, path)):
                bad.append(f"{name}: path {path}")
    assert not bad, "\n".join(bad)


def test_each_docs_page_is_linked_from_the_readme_with_a_summary():
    more = _section("More")
    for page in DOC_PAGES:
        m = re.search(rf"^- \[[^\]]+\]\(docs/{re.escape(page)}\): (.+)$", more, re.M)
        assert m and len(m.group(1)) > 30, page
    assert "](docs_internal/README.md)" in more


def test_the_docs_internal_map_names_every_note():
    index = _read("docs_internal", "README.md")
    for f in os.listdir(os.path.join(REPO, "docs_internal")):
        if f != "README.md":
            assert (f"]({f})" if f.endswith(".md") else f"`{f}/`") in index, f


def test_the_readme_reads_in_five_minutes_in_its_order():
    assert len(README.encode()) <= 16_000, len(README.encode())
    order = ["## The two commands", "## On a GPU server", "## Flags", "## Config", "## More"]
    at = [README.index(h) for h in order]
    assert at == sorted(at)


def test_the_config_snippet_loads(tmp_path):
    from sglang_cp.l3.config import load_l3_config

    snippet = re.search(r"```\n(namespace = .*?)```", _section("Config"), re.S).group(1)
    root = tmp_path / "nvme0"
    (root / "sglang-cp" / "index").mkdir(parents=True)
    path = tmp_path / "l3.toml"
    path.write_text(snippet.replace("/nvme0/", f"{root}/").replace('plp_policy = "warn"', 'plp_policy = "ignore"'))
    cfg = load_l3_config(str(path))
    assert cfg.namespace == "server-a" and cfg.disks[0].name == "nvme0"
