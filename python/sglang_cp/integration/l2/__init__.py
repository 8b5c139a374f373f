"""Hugepage-backed HiCache host pools and upstream's own hugepage allocator made strict."""
