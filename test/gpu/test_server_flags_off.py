"""The plugin installed but no flag given changes nothing a client can see.

Two real servers on the same dummy-weight model and seed: one with the plugin loaded and
none of its flags, one with the kill switch ``SGLANG_CP_DISABLE=1``. Greedy output ids of
the same prompts must be identical, with and without a device prefix hit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_support import base_dir, prompt, server

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["mla", "mha"])
def test_no_flags_same_output_ids_as_disabled_plugin(model, tmp_path_factory):
    root = base_dir(tmp_path_factory, f"off-{model}")
    prompts = [prompt(1500, 7), prompt(700, 8)]
    runs = {}
    for tag, env_extra in (("plugin-loaded", {}), ("plugin-disabled", {"SGLANG_CP_DISABLE": "1"})):
        srv = server(model, [], root, tag)
        srv.env.update(env_extra)
        with srv as s:
            # twice each: the second is a device prefix hit on the same radix cache
            runs[tag] = [s.generate(p, 16).output_ids for p in prompts for _ in range(2)]
        # the launcher of each run does (or does not) carry the plugin's flags
        helptext = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                                  capture_output=True, text=True, env=srv.env, timeout=300).stdout
        assert ("--enable-cp-l3" in helptext) == (tag == "plugin-loaded"), tag
    assert all(len(ids) == 16 for ids in runs["plugin-loaded"])
    assert runs["plugin-loaded"] == runs["plugin-disabled"]
