import gzip

import pandas as pd

from posinterp.io import atomic_write_csv_gz


def test_gzipped_tables_are_the_same_bytes_for_the_same_rows_whatever_the_file(tmp_path):
    """No file name and mtime 0 in the gzip header: two writes of the same rows, to files
    of other names at other times, are byte-equal, and read back as the rows."""
    df = pd.DataFrame({"seed": [0, 1, 2], "value": [0.5, float("nan"), 1e-9]})
    a = atomic_write_csv_gz(tmp_path / "a.csv.gz", df)
    b = atomic_write_csv_gz(tmp_path / "sub" / "other-name.csv.gz", df)
    assert a.read_bytes() == b.read_bytes()
    assert gzip.decompress(a.read_bytes()).decode() == df.to_csv(index=False)
    pd.testing.assert_frame_equal(pd.read_csv(b), df)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.csv.gz", "other-name.csv.gz", "sub"]
