"""Absurd numbers and undecodable files are config errors naming the field, one line each.

Each of these used to escape as a ValueError / OverflowError / UnicodeDecodeError traceback, or
(io.max_inflight_pages) to fail inside the store's open after cold start 'clear' had already wiped
the rank's index. The loader is the boundary: nothing is opened before it accepts the file.
"""

import pytest

from sglang_cp.l3 import L3ConfigError, load_l3_config


def toml(l3_root, *, index="", io="", capacity="0.02"):
    return f"""
[index]
dir = "{l3_root}/idx"
{index}
[durability]
plp_policy = "ignore"
[io]
{io}
[[disks]]
name = "d0"
path = "{l3_root}/d0"
capacity_gb = {capacity}
"""


@pytest.mark.parametrize("kw, field", [
    (dict(capacity="nan"), "disks[0].capacity_gb"),
    (dict(capacity="inf"), "disks[0].capacity_gb"),
    (dict(capacity="1e300"), "disks[0].capacity_gb"),
    (dict(capacity="1e10"), "disks[0].capacity_gb"),
    (dict(capacity="100000000000000000000000000"), "disks[0].capacity_gb"),
    (dict(index="map_size_gb = nan"), "index.map_size_gb"),
    (dict(index="map_size_gb = inf"), "index.map_size_gb"),
    (dict(index="map_size_gb = 1e300"), "index.map_size_gb"),
    (dict(index="max_map_size_gb = 1e300"), "index.max_map_size_gb"),
    (dict(index="max_map_size_gb = -inf"), "index.max_map_size_gb"),
    (dict(io="max_inflight_pages = 1000000000"), "io.max_inflight_pages"),
])
def test_absurd_numbers_name_the_field(l3_root, tmp_path, kw, field):
    p = tmp_path / "l3.toml"
    p.write_text(toml(l3_root, **kw))
    with pytest.raises(L3ConfigError) as e:
        load_l3_config(str(p))
    msg = str(e.value)
    assert msg.startswith(field + ":"), msg
    assert "\n" not in msg


def test_a_large_map_keeps_a_mappable_default_max(l3_root, tmp_path):
    p = tmp_path / "l3.toml"
    p.write_text(toml(l3_root, index="map_size_gb = 10000"))
    c = load_l3_config(str(p))
    assert c.index.max_map_size_bytes <= 2**46 and c.index.max_map_size_bytes >= c.index.map_size_bytes


def test_non_utf8_file_is_one_line_naming_the_flag(l3_root, tmp_path):
    p = tmp_path / "l3.toml"
    p.write_bytes(toml(l3_root).encode().replace(b'name = "d0"', b'name = "d\xff0"'))
    with pytest.raises(L3ConfigError) as e:
        load_l3_config(str(p))
    msg = str(e.value)
    assert msg.startswith("--cp-l3-config:") and "not UTF-8" in msg and "\n" not in msg


def test_unreadable_file_names_the_flag(l3_root, tmp_path):
    p = tmp_path / "l3.toml"
    p.write_text(toml(l3_root))
    p.chmod(0)
    try:
        open(p).close()
        pytest.skip("running as a user that reads mode-000 files (root)")
    except PermissionError:
        pass
    with pytest.raises(L3ConfigError, match="--cp-l3-config: cannot read"):
        load_l3_config(str(p))


@pytest.mark.parametrize("value, msg", [
    ("0.01", r"io\.gil_switch_interval_ms: must be 0 \(leave CPython's 5 ms\) or in \[0\.05, 5\.0\], got 0\.01; "
             r"e\.g\. 0\.5"),
    ("6", r"io\.gil_switch_interval_ms: must be 0 \(leave CPython's 5 ms\) or in \[0\.05, 5\.0\], got 6\.0"),
    ("-1", r"io\.gil_switch_interval_ms: must be 0 .*got -1\.0"),
    ("nan", r"io\.gil_switch_interval_ms: must be a finite number"),
    ('"0.5"', r"io\.gil_switch_interval_ms: must be a number, got str '0\.5'"),
    ("true", r"io\.gil_switch_interval_ms: must be a number, got bool True"),
])
def test_a_bad_switch_interval_names_the_field_and_a_value(l3_root, tmp_path, value, msg):
    p = tmp_path / "l3.toml"
    p.write_text(toml(l3_root, io=f"gil_switch_interval_ms = {value}"))
    with pytest.raises(L3ConfigError, match=msg) as e:
        load_l3_config(str(p))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, want", [("", 0.0), ("gil_switch_interval_ms = 0", 0.0),
                                        ("gil_switch_interval_ms = 0.5", 0.5), ("gil_switch_interval_ms = 5", 5.0)])
def test_the_switch_interval_defaults_to_leaving_cpythons_own(l3_root, tmp_path, text, want):
    p = tmp_path / "l3.toml"
    p.write_text(toml(l3_root, io=text))
    assert load_l3_config(str(p)).io.gil_switch_interval_ms == want
