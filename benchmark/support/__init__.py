"""What tests and benchmarks share and users never run: a real ``sglang.launch_server`` child
(``server_process``), a PD pair of them (``pd_pair``), and the CP rank testbed with the tests' start
method (``cp_harness``). Imported as ``benchmark.support.<module>`` from the repository root."""
