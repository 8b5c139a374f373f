"""Lists that must stay copies of one definition, because the place that holds the copy may not import
the original: the plugin's flag names (its failure notice runs when sglang_cp.args failed to import)."""

from sglang_cp import args, plugin


def test_the_plugins_flag_list_is_args_flags():
    assert list(plugin.FLAGS) == [flag for flag, _kwargs in args.arg_specs()]
    assert [f[2:].replace("-", "_") for f in plugin.FLAGS] == list(args.FLAG_NAMES)


def test_cold_start_modes_and_default_have_one_definition():
    from sglang_cp.cachebench import runner
    from sglang_cp.l3 import recovery, store

    assert args.COLD_START_CHOICES is recovery.COLD_START_MODES is runner.COLD_START_MODES
    assert args.CpFlags().cp_l3_cold_start == recovery.DEFAULT_COLD_START
    spec = dict(args.arg_specs())["--cp-l3-cold-start"]
    assert spec["choices"] is recovery.COLD_START_MODES and spec["default"] == recovery.DEFAULT_COLD_START
    import inspect
    assert inspect.signature(store.L3Store).parameters["cold_start"].default == recovery.DEFAULT_COLD_START
