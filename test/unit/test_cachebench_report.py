"""cachebench's PNG plots the table's quantity: L3 GB/s of all ranks over the slowest rank's I/O time.

Its throughput panel used to show (read + write bytes) / request time per rank, 0.03-0.09 GB/s,
which no column of the table (read GB/s over read time) could be matched to.
"""

import random
import warnings

from sglang_cp.cachebench import report


def _ranks(n_req=12, seed=3):
    rnd = random.Random(seed)
    ranks = []
    for rank in range(2):
        recs = []
        for i in range(n_req):
            rd = rnd.choice([0, 1 << 20, 3 << 20])
            wr = rnd.choice([0, 2 << 20])
            recs.append({"phase": "pressure", "t": float(i), "dt": 0.5, "pages": 10, "l2": 2, "l3": 5,
                         "computed": 3, "read_bytes": rd, "write_bytes": wr,
                         "t_read": rd / 1e9 * (1 + rank), "t_write": wr / 2e9, "store_errors": 0})
        ranks.append({"rank": rank, "records": recs, "errors": [], "restart_cold_start": {},
                      "occupancy_after_restart": {}, "page_bytes": 1})
    return ranks


def test_the_rolling_rate_over_a_whole_phase_is_the_tables():
    ranks = _ranks()
    table = report.summarize({}, {}, ranks, 1.0)["phases"]["pressure"]
    idx = list(range(12))
    assert abs(report.rolling_gbps(ranks, idx, 12, "read")[-1] - table["l3_read_gbps"]) < 1e-12
    assert abs(report.rolling_gbps(ranks, idx, 12, "write")[-1] - table["l3_write_gbps"]) < 1e-12


def test_a_window_that_moved_nothing_is_a_gap_not_zero():
    ranks = _ranks()
    for r in ranks:
        for x in r["records"][:3]:
            x["read_bytes"], x["t_read"] = 0, 0.0
    assert report.rolling_gbps(ranks, list(range(12)), 2, "read")[:3] == [None, None, None]


def test_the_plot_draws_with_its_legends(tmp_path):
    ranks = _ranks()
    png = tmp_path / "c.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "No artists with labels found": a legend lost
        report.plot(ranks, str(png), raw={"read_gbps": 1.5, "write_gbps": 2.0})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
