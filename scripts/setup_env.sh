#!/usr/bin/env bash
# One-command setup of the sglang-cp development environment on a fresh machine.
#
#   bash scripts/setup_env.sh            # creates/updates .venv in the repo root
#
# Idempotent: every step checks what is already installed and skips itself, so a
# second run takes seconds. Order matters:
#   1. torch 2.14.1 + torchvision 0.29.1 (sglang 0.5.23's pin), from wherever pip's own
#      configuration points (the machine's local wheel dir and indexes).
#   2. sglang==0.5.23 with --no-deps: its declared deps include CUDA-only kernels
#      (flashinfer, sgl-kernel, flash-attn, ...) that neither install nor are needed
#      to import the modules we hook.
#   3. the pure-Python packages those modules import, pinned by scripts/constraints.txt.
#   4. this project, editable, with its test extras.
# The installer is uv (pinned, installed into the venv) where it can be had, given pip's own
# configuration (find-links, index URLs, constraint file, certificate) so that it installs the same
# pinned versions from the same places, in a fraction of pip's time; pip where uv cannot be had or
# a step fails under it (the log says so). SGLANG_CP_SETUP_INSTALLER=pip forces pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SGLANG_CP_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
CONSTRAINTS="scripts/constraints.txt"
t0=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "need Python 3.11, got %s" % sys.version' 

# Print the requirements (name==version) that are not installed at exactly that version.
missing() {
  "$VPY" - "$@" <<'PYEOF'
import sys, importlib.metadata as md
for req in sys.argv[1:]:
    name, _, ver = req.partition("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or (ver and have != ver):
        print(req)
PYEOF
}

UV_PIN="uv==0.13.9"
UV=""
UV_ARGS=()
# uv reads none of pip's configuration: scripts/uv_args.py hands it pip's (files and PIP_* variables)
# so both installers see the same wheel dirs, indexes and constraints.
uv_args_from_pip_config() {
  local line out
  out="$("$VPY" scripts/uv_args.py)" || return 1
  while IFS= read -r line; do
    case "$line" in
      SSL_CERT_FILE=*) export SSL_CERT_FILE="${line#SSL_CERT_FILE=}" ;;
      ?*) UV_ARGS+=("$line") ;;
    esac
  done <<< "$out"
}
if [ "${SGLANG_CP_SETUP_INSTALLER:-uv}" = uv ]; then
  if { [ -z "$(missing "$UV_PIN")" ] || "$VPY" -m pip install -q --disable-pip-version-check "$UV_PIN" >/dev/null 2>&1; } \
      && uv_args_from_pip_config; then
    UV="$VENV/bin/uv"
  else
    echo "[setup] uv ($UV_PIN) could not be installed, or pip's configuration not read: installing with pip"
  fi
fi

pip_install() {
  # sglang was installed with --no-deps on purpose (its CUDA-only requirements do not
  # install here), so pip's resolver report about them is expected: keep it out of the log.
  # --no-compile: the installers byte-compile on one core; compileall below does it on every core, once.
  "$VPY" -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 \
    | grep -v -e "is ignored: it is neither" -e "^sglang 0.5.23 requires " \
              -e "^ERROR: pip's dependency resolver does not currently take into account" \
              -e "^This behaviour is the source of the following dependency conflicts" || true
}

step() {  # step LABEL PIP_ARGS...; requirements = args not starting with '-'
  local label="$1"; shift
  local reqs=() a
  for a in "$@"; do case "$a" in -*) ;; *) reqs+=("$a") ;; esac; done
  if [ -z "$(missing "${reqs[@]}")" ]; then
    echo "[setup] $label: already installed"
    return 0
  fi
  local s=$SECONDS
  echo "[setup] $label: installing${UV:+ (uv)}"
  # unsafe-best-match: like pip, take the best match of a pin from every index, not the first index's.
  if [ -z "$UV" ]; then
    pip_install "$@"
  elif ! "$UV" pip install -q --python "$VPY" --no-compile --index-strategy unsafe-best-match "${UV_ARGS[@]}" "$@"; then
    echo "[setup] $label: uv failed (above): installing with pip"
    pip_install "$@"
  fi
  [ -z "$(missing "${reqs[@]}")" ] || { echo "[setup] $label: FAILED to install: $(missing "${reqs[@]}")"; exit 1; }
  echo "[setup] $label: done in $((SECONDS - s)) s"
  INSTALLED=1
}
INSTALLED=0

# A C compiler: the crash test's power-loss model builds a small LD_PRELOAD shim.
if ! command -v cc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] cc: installing gcc (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null
  fi
  command -v cc >/dev/null 2>&1 || { echo "[setup] need a C compiler (cc) for the power-loss tests: install gcc"; exit 1; }
fi

step "torch" torch==2.14.1 torchvision==0.29.1
step "sglang (no deps)" --no-deps sglang==0.5.23
step "sglang's pure-Python imports" --constraint="$CONSTRAINTS" \
  numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
  packaging==26.4 pillow==13.0.0 starlette==1.10.0 msgspec==0.22.0 pydantic==2.14.4 \
  pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 \
  transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 uvloop==0.23.0 \
  setproctitle==1.3.8 dill==0.4.1 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
  gguf==0.19.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2 \
  uvicorn==0.54.0 fastapi==0.165.0 jsonschema==4.26.0 xgrammar==0.2.7 \
  soundfile==0.13.1 python-multipart==0.0.34 pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 \
  lmdb==3.0.0 prometheus_client==0.26.0 rich==15.0.0 crc32c==2.9.post0 hypothesis==6.155.2
# A sampling profiler for bench_server_ttft --profile (benchmark/hicache/pyspy_profile.py) and its test.
step "py-spy (profiles)" py-spy==0.4.3
# cachebench's PNG plot (matplotlib pulls contourpy, cycler, fonttools, kiwisolver,
# pyparsing, python-dateutil; dateutil < 3 because sglang 0.5.23 declares that bound).
step "matplotlib (cachebench plot)" --constraint="$CONSTRAINTS" \
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
  pyparsing==3.3.3 python-dateutil==2.9.0.post0 six==1.17.0

# Byte-compile what the steps installed, on all cores (compileall skips files whose .pyc is current);
# without it every first import would compile, in every process that gets there first.
if [ "$INSTALLED" = 1 ]; then
  s=$SECONDS
  "$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  echo "[setup] byte-compiled site-packages in $((SECONDS - s)) s"
fi

# The project itself (editable). Re-installed only when its build inputs changed (pyproject.toml,
# setup.py, the native library's C sources), so the entry points (plugin group, console script) match
# the checked-out metadata and python/sglang_cp/l3/_native*.so (built in place) matches its sources.
stamp="$VENV/.sglang_cp_build.sha"
want="$(cat pyproject.toml setup.py python/sglang_cp/l3/native/*.[ch] | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VPY" -c 'import sglang_cp' 2>/dev/null; then
  s=$SECONDS
  echo "[setup] sglang-cp (editable): installing"
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
  "$VPY" -c 'import sglang_cp' || { echo "[setup] sglang-cp failed to install"; exit 1; }
  "$VPY" -c 'from sglang_cp.l3 import native; native.load("setup", "native")' \
    || { echo "[setup] sglang-cp's native library (sglang_cp/l3/_native) did not build: see the warning above"; exit 1; }
  echo "$want" > "$stamp"
  echo "[setup] sglang-cp: done in $((SECONDS - s)) s"
else
  echo "[setup] sglang-cp (editable): already installed"
fi
echo "[setup] environment ready in $((SECONDS - t0)) s ($VENV)"
