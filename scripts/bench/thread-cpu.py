#!/usr/bin/env python3
"""CPU use of each thread group of running processes, over a window.

Usage: scripts/bench/thread-cpu.py SECONDS OUT.json NAME=PID [NAME=PID ...]

Samples /proc/PID/task/*/stat (utime + stime) at the start and the end of
the window and writes, per process and per thread group, the cores it kept
busy on average (1.0 = one core all the time). Threads are grouped by name
with trailing digits dropped ("tokenize-3" -> "tokenize-", "ZMQbg/IO/0" ->
"ZMQbg/IO/"), so a pool shows as one line with its thread count. A process's
children (the daemon's worker processes) are included under NAME/child.

This is how the benchmarks say which stage of the host path is busy: the
tokio runtime's threads ("replayd"), the tokenizer pool ("tokenize-"),
libzmq's I/O threads, the worker processes.
"""
import json
import os
import re
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid):
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            raw = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        # comm is in parentheses and may contain spaces.
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(tid)] = (comm, int(fields[11]) + int(fields[12]))
    return out


def children(pid):
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                kids += [int(c) for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return kids


def snapshot(procs):
    snap = {}
    for name, pid in procs:
        snap[(name, pid)] = threads(pid)
        for kid in children(pid):
            snap[(f"{name}/child", kid)] = threads(kid)
    return snap


def main():
    seconds = float(sys.argv[1])
    out_path = sys.argv[2]
    procs = [(a.split("=", 1)[0], int(a.split("=", 1)[1])) for a in sys.argv[3:]]
    before = snapshot(procs)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = snapshot(procs)
    wall = time.monotonic() - t0
    groups = {}
    for (name, pid), ths in after.items():
        prev = before.get((name, pid), {})
        for tid, (comm, ticks) in ths.items():
            used = ticks - prev.get(tid, (comm, 0))[1] if tid in prev else ticks
            key = (name, re.sub(r"\d+$", "", comm))
            g = groups.setdefault(key, {"threads": 0, "cores": 0.0, "busiest": 0.0})
            cores = used / TICK / wall
            g["threads"] += 1
            g["cores"] += cores
            g["busiest"] = max(g["busiest"], cores)
    rows = [
        {"process": p, "threads": t, **{k: round(v, 3) for k, v in g.items() if k != "threads"}, "thread_count": g["threads"]}
        for (p, t), g in sorted(groups.items(), key=lambda kv: -kv[1]["cores"])
    ]
    json.dump({"seconds": round(wall, 2), "cores_total": os.cpu_count(), "groups": rows}, open(out_path, "w"), indent=1)
    for r in rows:
        if r["cores"] >= 0.005:
            print(f"{r['process']:>14} {r['threads']:<18} x{r['thread_count']:<3} {r['cores']:6.2f} cores  (busiest thread {r['busiest']:.2f})")


if __name__ == "__main__":
    main()
