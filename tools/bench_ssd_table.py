"""bench_ssd's final table: one row per block shape, GB/s cold | warm | write, ratios."""

from __future__ import annotations

COLUMNS = [  # (key, header, format)
    ("block_mib", "MiB", "{:.1f}"),
    ("num", "N", "{:.0f}"),
    ("raw_seq_cold", "seq", "{:.2f}"),
    ("raw_files_cold", "files", "{:.2f}"),
    ("load_cold", "load", "{:.2f}"),
    ("stream_cold", "stream", "{:.2f}"),
    ("buf_load_cold", "buf", "{:.2f}"),
    ("mxl_load_cold", "mxl", "{:.2f}"),
    ("lmdb_load_cold", "lmdb", "{:.2f}"),
    ("raw_seq_warm", "seq", "{:.2f}"),
    ("raw_files_warm", "files", "{:.2f}"),
    ("load_warm", "load", "{:.2f}"),
    ("stream_warm", "stream", "{:.2f}"),
    ("buf_load_warm", "buf", "{:.2f}"),
    ("mxl_load_warm", "mxl", "{:.2f}"),
    ("lmdb_load_warm", "lmdb", "{:.2f}"),
    ("raw_write", "raw", "{:.2f}"),
    ("writer", "writer", "{:.2f}"),
    ("lmdb_write", "lmdb", "{:.2f}"),
    ("put_us", "put us", "{:.0f}"),
    ("stream_cold_vs_raw_seq", "c/seq", "{:.0%}"),
    ("stream_cold_vs_raw_files", "c/files", "{:.0%}"),
    ("stream_warm_vs_raw_seq", "w/seq", "{:.0%}"),
    ("stream_warm_vs_raw_files", "w/files", "{:.0%}"),
    ("write_ratio", "w/raw", "{:.0%}"),
]


def print_table(rows: dict[str, dict[str, float]]) -> None:
    print(
        "\nGB/s of payload file bytes. Reads: cold (page cache dropped) | warm; writes.\n"
        "seq: one file of the same total size read with a 1 MiB buffer; files: each payload\n"
        "file read into fresh memory; load: SsdTier.load; buf / mxl: the two payload readers\n"
        "forced; lmdb: payloads as LMDB values. Ratios: stream vs seq / files (median of\n"
        "per-repetition ratios), writer vs raw write + fsync."
    )
    head = ["shape", *(h for _, h, _ in COLUMNS)]
    lines = [head, ["", "", "", *["cold"] * 7, *["warm"] * 7, *["write"] * 3]]
    lines[1] += [""] * (len(head) - len(lines[1]))
    for shape, r in rows.items():
        r = {**r, "write_ratio": r["writer"] / r["raw_write"]}
        lines.append([shape, *(fmt.format(r[key]) for key, _, fmt in COLUMNS)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
