"""Offline tools over an L3 directory, run by ``sglang-cp l3 fsck`` / ``l3 stats`` while no store (or a
live one) holds it: ``fsck`` (check every slab and index entry) and ``occupancy`` (what each rank and
payload holds). They read the on-disk format (``l3.format``), the config and the cold-start records;
the store never imports them (test/unit/l3/test_l3_module_shape.py checks it)."""
