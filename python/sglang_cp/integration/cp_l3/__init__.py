"""The L3 tier as upstream's HiCache storage backend: the backend class, its keys and rank identity, the storage config, backup operations and the restore path."""
