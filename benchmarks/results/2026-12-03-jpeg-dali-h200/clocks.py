"""Summarise `nvidia-smi dmon -s pucv -o DT` samples per run window (probe_next.sh): for the samples of each window
in which the SMs were busy (sm >= 50%), the medians of power (W), SM clock (MHz), SM and JPEG-engine use (%) and
the share of time the clocks were held back by the power or thermal limit (pviol, tviol: %).
Columns are found by the header's names, so a driver without one prints '-'."""

import statistics
import sys


def read_samples(path):
    names, rows = None, []
    for line in open(path):
        fields = line.split()
        if line.startswith("#") and names is None:
            names = [n.lstrip("#").lower() for n in fields]
        elif fields and not line.startswith("#") and names and len(fields) == len(names):
            rows.append(dict(zip(names, fields)))
    return rows


def number(row, name):
    try:
        return float(row[name])
    except (KeyError, ValueError):
        return None


def main(dmon_path, windows_path):
    rows = read_samples(dmon_path)
    starts, windows = {}, []
    for line in open(windows_path):
        kind, name, time = line.split()
        if kind == "start":
            starts[name] = time
        else:
            windows.append((name, starts.pop(name), time))
    columns = ("pwr", "pclk", "sm", "jpg", "pviol", "tviol")
    print("run                      samples " + " ".join(f"{c:>7}" for c in columns))
    for name, start, end in windows:
        inside = [r for r in rows if start <= r.get("time", "") <= end and (number(r, "sm") or 0) >= 50]
        medians = []
        for c in columns:
            values = [v for v in (number(r, c) for r in inside) if v is not None]
            medians.append(f"{statistics.median(values):7.0f}" if values else "      -")
        print(f"{name:24} {len(inside):7} " + " ".join(medians))


if __name__ == "__main__":
    main(*sys.argv[1:3])
