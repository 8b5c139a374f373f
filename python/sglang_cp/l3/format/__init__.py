"""What the L3 store keeps on disk and how it is read and written: the blob header and slot geometry
(``blob``), O_DIRECT buffers (``aligned``), slab files (``disk_slab``), the LMDB index (``index``),
private files and directories (``files``) and the per-rank lock files (``ownership``).

These modules outlive a store: a running store, the offline tools (``l3.tools``) and any future
reader share them. They import nothing of ``l3`` outside this package but ``l3.errors``
(test/unit/l3/test_l3_module_shape.py checks it)."""
