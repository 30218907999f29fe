#!/usr/bin/env python3
"""Registers, spills and shared memory of each CUDA kernel for sm_90, from
ptxas itself, on a machine without a GPU.

Compiles kernels/ as the backend does (the files in the order of
`KERNEL_FILES` in src/backend/cuda/kernel_sources.rs, one translation unit) with
the NVRTC that scripts/dev/install-nvrtc.sh puts in .nvrtc/, with `-Xptxas=-v`,
and prints one line per entry point whose name contains one of the given
words (all of them without words). The whole compile takes a few minutes.

    scripts/gpu/kernel-resources.py gemm_small pool_ln
"""
import ctypes
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = os.path.join(REPO, ".nvrtc", "nvidia", "cu13", "lib")


def sources():
    rs = open(os.path.join(REPO, "src", "backend", "cuda", "kernel_sources.rs")).read()
    start = rs.index("pub const KERNEL_FILES")
    table = rs[start:rs.index("];", start)]
    files = re.findall(r'^\s*"([^"]+\.cuh?)",', table, re.M)
    return "".join(f'#line 1 "{f}"\n' + open(os.path.join(REPO, "kernels", f)).read() + "\n" for f in files)


def main():
    if not os.path.exists(os.path.join(LIB, "libnvrtc.so.13")):
        sys.exit(f"no NVRTC in {LIB}: run scripts/dev/install-nvrtc.sh")
    # libnvrtc loads its builtins library by name: from the same folder.
    if LIB not in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        os.environ["LD_LIBRARY_PATH"] = LIB + ":" + os.environ.get("LD_LIBRARY_PATH", "")
        os.execv(sys.executable, [sys.executable] + sys.argv)
    nvrtc = ctypes.CDLL(os.path.join(LIB, "libnvrtc.so.13"))
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), sources().encode(), b"replayd_kernels.cu", 0, None, None)
    if rc != 0:
        sys.exit(f"nvrtcCreateProgram: {nvrtc.nvrtcGetErrorString(rc).decode()}")
    opts = [b"-arch=sm_90", b"--std=c++17", b"-Xptxas=-v"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"nvrtcCompileProgram: {nvrtc.nvrtcGetErrorString(rc).decode()}\n{text[-4000:]}")
    words = sys.argv[1:]
    print("| kernel | registers | spill stores / loads (bytes) | stack frame | shared memory (bytes) |")
    print("|---|---|---|---|---|")
    # ptxas -v: "Compiling entry function 'NAME'", then a properties line with
    # the stack frame and spills, then "Used N registers, ... M bytes smem".
    name = frame = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name, frame = m.group(1), None
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            frame = m.groups()
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name and frame:
            smem = re.search(r"(\d+) bytes smem", line)
            if not words or any(w in name for w in words):
                print(f"| {name} | {m.group(1)} | {frame[1]} / {frame[2]} | {frame[0]} | {smem.group(1) if smem else 0} |")
            name = None


if __name__ == "__main__":
    main()
